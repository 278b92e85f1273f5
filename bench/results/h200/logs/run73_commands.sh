# Session 22, after run 72: the cp.async copy loops unrolled (the state pass's
# cs_stage_piece and H, the chunk kernels' csg::copy_tile), so that no copy's address
# registers wait for the copy before. Bitwise the values before in the emulator.
# `bash <this> <part> <commit> <base commit>` (base: e613d40, run 72's kernels).
# part a: the CUDA tests; Nsight Compute's kernel times at 16384, new and base/; phase
#   clocks.
# part b: fla and chunkscan side by side at 16384 and 65536.
# Outputs in $OUT/run73<part>.tgz.
source bench/device_run.sh 73 "$@"  # st, $BASE, $S, pack, cuda_tests, ncu_kernels, ...
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
fi
st done
