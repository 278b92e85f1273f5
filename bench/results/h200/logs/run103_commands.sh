# Run 103 (session 37): the code at the commit passed, on an H200 if one starts (runs
# 101-102 came on an H100). Session 36 changed the CUDA kernel cache (_precompile: a
# damaged cached binary rebuilt, the line-information switch in the in-process key)
# without a GPU after it; no kernel source changed. This run:
#   a: the CUDA tests of the attention kernels, of the kernel cache
#      (tests/test_precompile.py, whole) and of the state passes, fused chunk kernels and
#      rows (cuda_tests);
#   b: two side-by-side samples at T = 16384 beside fla, ten repeats (samples_16384);
#   c: the LoRA step of the 4-layer model at T = 8192, stub and patched (lora_8192).
# After the set-up call: `bash <this> <part> <commit> c652525` (the commit written out, not
# $(git rev-parse ...): the device's copy of the tree has stale git metadata); outputs in
# $OUT/run103<part>.tgz.
source bench/device_run.sh 103 "$@"  # st, $S, pack, cuda_tests, samples_16384, lora_8192
case "$RUN_PART" in
a)
  st attention_tests
  MLX_ENABLE_TF32=0 timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/ops/test_attention_cuda.py -k "cuda and not emulated" 2>&1 \
    | tee $S/tests_h200_attention.txt | grep -E "passed|failed|^FAILED|Error" | tail -6
  pack
  st precompile_tests
  timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rs tests/test_precompile.py 2>&1 \
    | tee $S/tests_h200_precompile.txt | grep -E "passed|failed|^FAILED|Error" | tail -6
  pack
  st tests
  cuda_tests
  pack
  ;;
b)
  cd bench
  samples_16384 2
  ;;
c)
  st lora
  lora_8192
  pack
  ;;
esac
st done
