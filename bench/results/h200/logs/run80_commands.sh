# Session 24, run 80: main with the spread tiles but for prepare's w and u (run 79: prepare
# slower spread) and with input_grads' t1, t2 spread (d_kk + d_kk^T read down its columns:
# symmetric). The chunk kernels' CUDA tests (test_gated_delta_fused.py), Nsight
# Compute, fla side by side at 16384 and 65536. `bash <this> a <commit> <commit>`.
# Outputs in $OUT/run80a.tgz.
source bench/device_run.sh 80 "$@"  # st, $S, pack, ncu_kernels, fla_side_by_side
st tests
MLX_ENABLE_TF32=0 timeout 200 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py -k "(cuda or tf32) and not emulated" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -12
pack
cd bench
st ncu
ncu_kernels new
pack
st fla
fla_side_by_side
pack
st done
