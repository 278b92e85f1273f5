# Session 21, after run 68: the loads that waited one after the other now in flight
# together or behind products (csg::TileLoad: prepare's k and q, and v behind w's product;
# output_h's d_o behind X; state_grads' d_o and v; input_grads' k and q, its d_w, d_p and
# m2 copied in the background with one slice) and output's w in a region of its own, so
# that the forward's S is copied from the block's start (OWN_W). Bitwise the values
# before in the emulator. `bash <this> <part> <commit> <base commit>` (base: 02db935,
# run 68's kernels).
# part a: the CUDA tests; Nsight Compute's kernel times at 16384, new and base/; phase
#   clocks.
# part b: fla and chunkscan side by side at 16384 and 65536; the LoRA step at 8192.
# Outputs in $OUT/run69<part>.tgz.
source bench/device_run.sh 69 "$@"  # st, $BASE, $S, pack, cuda_tests, ncu_kernels, ...
if [ "$1" = a ]; then
  st tests
  cuda_tests
  pack
  cd bench
  st ncu
  ncu_kernels new
  pack
  st ncu_base
  ncu_base
  pack
  st profile
  timeout 60 python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64.json 2>&1 \
    | grep -v CSPROF
  pack
else
  cd bench
  st fla
  fla_side_by_side
  pack
  cd ..
  st lora
  lora_8192
  pack
fi
st done
