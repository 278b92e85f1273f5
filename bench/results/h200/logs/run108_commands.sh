# Run 108 (session 39): input_grads without its unread template constant TVO (3b35973's
# kernel body unchanged; a new kernel name), the fused kernels' CUDA tests on it, and
# Nsight Compute's kernel times under CHUNKSCAN_GDN_NT=256 (input_grads' 256-thread form,
# not timed since it took a loop over the value heads; every kernel takes 256 there).
# After the set-up call, `bash <this> <part> <commit> d6fbb12` (the commit written out;
# base/ is not used); outputs in $OUT/run108<part>.tgz:
#   a: ncu_kernels new, ncu_kernels nt256 CHUNKSCAN_GDN_NT=256, the CUDA tests of the
#      fused chunk kernels and of the rows;
#   b: two side-by-side samples at T = 16384 beside fla, ten repeats (samples_16384).
source bench/device_run.sh 108 "$@"  # st, $S, pack, ncu_kernels, cuda_tests, samples_16384
case "$RUN_PART" in
a)
  cd bench
  st ncu
  ncu_kernels new
  pack
  st ncu_nt256
  ncu_kernels nt256 CHUNKSCAN_GDN_NT=256
  pack
  cd ..
  st tests
  cuda_tests tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_rows.py
  pack
  ;;
b)
  cd bench
  samples_16384 2
  ;;
esac
st done
