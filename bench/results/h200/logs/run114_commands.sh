# Run 114 (session 41). After the set-up call, `bash <this> <part> <commit> 1b133f9`
# (base/ is not used); outputs in $OUT/run114<part>.tgz:
#   a: the CUDA tests of the fused chunk kernels and the state passes (session 41 made
#      a forced tiling the shape cannot take raise, in the code that picks the kernels;
#      the kernels themselves are unchanged), then chunkscan.linear_attention beside
#      mlx-lm's two recurrent_gla on the GPU (bench/linear_attention.py);
#   b: issue 9: one side-by-side sample at T = 16384, ten repeats (samples_16384 1),
#      then the LoRA step of the 4-layer model at T = 8192 (lora_8192).
source bench/device_run.sh 114 "$@"  # st, $S, pack, cuda_tests, samples_16384, lora_8192
case "$RUN_PART" in
a)
  st tests
  MLX_ENABLE_TF32=0 timeout 330 python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py \
    -k "(cuda or tf32) and not emulated" 2>&1 \
    | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -12
  pack
  st linear_attention
  cd bench
  timeout 200 python3 linear_attention.py --T 2048 8192 --loop-max-T 8192 --repeats 3 \
    --json $S/linear_attention_gpu.json --md $S/linear_attention_gpu.md 2>&1 | tail -12
  pack
  ;;
b)
  cd bench
  samples_16384 1
  cd ..
  st lora
  lora_8192
  pack
  ;;
esac
st done
