# Session 22, after run 71: the state pass's chunk scalars and H staged by cp.async (no
# global load waited for between chunks), its states written 8 bytes at a time;
# input_grads' epilogue reads issued before the products (TF32: d_vnew during dk, v
# during dv; q and k tested through Qs / Ks). Bitwise the values before in the emulator.
# `bash <this> <part> <commit> <base commit>` (base: 89268cd, run 71's kernels).
# part a: the CUDA tests; Nsight Compute's kernel times at 16384, new and base/; phase
#   clocks; warp stalls per source line of the state pass and input_grads.
# part b: fla and chunkscan side by side at 16384 and 65536.
# Outputs in $OUT/run72<part>.tgz.
source bench/device_run.sh 72 "$@"  # st, $BASE, $S, pack, cuda_tests, ncu_kernels, ...
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
  st source
  CHUNKSCAN_CUDA_LINEINFO=1 CHUNKSCAN_CUDA_CACHE=/tmp/c_li timeout 150 ncu --profile-from-start off \
    --clock-control none --section SourceCounters --import-source yes \
    --kernel-name regex:"state_pass_mma|gdn_input_grads" --launch-count 3 \
    -o $S/ncu_src python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
  ncu -i $S/ncu_src.ncu-rep --page source --csv --print-source cuda,sass > $S/ncu_src_cuda_sass.csv 2>&1
  gzip -f $S/ncu_src_cuda_sass.csv; rm -f $S/ncu_src.ncu-rep
  pack
else
  cd bench
  st fla
  fla_side_by_side
  pack
fi
st done
