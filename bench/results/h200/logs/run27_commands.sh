# device call of session 7's fourth machine (committed as bench/results/h200/logs/run27_commands.sh):
# the final code's CUDA tests (the non-finite count's contiguous scan, the arch-keyed binaries,
# the compiled NaN test), with the ~280 s of device time left
source bench/device_setup.sh >/dev/null 2>&1
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_final
MLX_ENABLE_TF32=0 timeout 125 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py tests/test_precompile.py \
  tests/ops/test_gated_delta.py -k "cuda or non_finite or nan or inf" 2>&1 | tee $OUT/tests_h200_cuda.txt | tail -3
