# Run 105 (session 38): input_grads with one block per key head, its value heads in turn
# (dq, dk summed in the block, written in the inputs' dtypes; the sum_value_heads kernel
# gone), emulator-tested only. Base: aa3bd86 (session 37's last code; base/ holds `git
# archive aa3bd86 src`). After the set-up call, `bash <this> <part> <commit> aa3bd86`
# (the commit written out); outputs in $OUT/run105<part>.tgz:
#   a: Nsight Compute's kernel times of one fwd+bwd at 16384, this code and base
#      (ncu_kernels new, ncu_base); the CUDA tests of the fused chunk kernels and of the
#      rows (cuda_tests; TF32 off there, so input_grads runs with 256 threads, and the
#      TF32 tests with 512);
#   b: two side-by-side samples at T = 16384 beside fla, ten repeats (samples_16384);
#   c: base's side by side at 16384 (one sample, the same command on base/'s sources),
#      then the LoRA step of the 4-layer model at T = 8192 (lora_8192).
source bench/device_run.sh 105 "$@"  # st, $S, pack, ncu_kernels, ncu_base, cuda_tests, ...
case "$RUN_PART" in
a)
  cd bench
  st ncu
  ncu_kernels new
  pack
  st ncu_base
  ncu_base
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
c)
  cd bench
  st side_by_side_base
  $BASE timeout 250 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan --modes eager \
    compiled --chunk-sizes 64 --repeats 10 --json $S/gdn_vs_fla_16384_h200_r10_base.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
  pack
  cd ..
  st lora
  lora_8192
  pack
  ;;
esac
st done
