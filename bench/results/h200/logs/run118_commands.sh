# Run 118 (session 41): the fused chunk kernels' and state passes' CUDA tests on the
# session's last code (supports(strict=...) and the tiling-knob errors came after run
# 114's tests). After the set-up call, `bash <this> a <commit> 1b133f9`; outputs in
# $OUT/run118a.tgz.
source bench/device_run.sh 118 "$@"  # st, $S, pack
st tests
MLX_ENABLE_TF32=0 timeout 240 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py \
  -k "(cuda or tf32) and not emulated" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -12
pack
st done
