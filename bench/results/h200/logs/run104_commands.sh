# Run 104 (session 37): non_finite_reach rewritten after run 103 (a tile of 1024 tokens
# at a time, where each thread took a span: 42 us in run 103's Nsight Compute, more than
# the 38.5 of the MLX kernels it replaced) and test_precompile's two tests that failed on
# the H200 in run 103 (test-side). One call after the set-up call:
#   the CUDA tests of the small kernels (tests/ops/test_gated_delta_rows.py, the op with
#   non-finite input among them) and tests/test_precompile.py, whole;
#   Nsight Compute's kernel times of one fwd+bwd at 16384 (ncu_kernels new);
#   the fused op's CUDA tests (cuda_tests on test_gated_delta_fused.py), last: cut by
#   its timeout where the budget ends.
# `bash <this> a <commit> c652525` (the commit written out); outputs in $OUT/run104a.tgz.
source bench/device_run.sh 104 "$@"  # st, $S, pack, cuda_tests, ncu_kernels
st rows_and_precompile_tests
MLX_ENABLE_TF32=0 timeout 150 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_rows.py tests/test_precompile.py 2>&1 \
  | tee $S/tests_h200_rows_precompile.txt | grep -E "passed|failed|^FAILED|Error|difference" | tail -8
pack
cd bench
st ncu
ncu_kernels new
pack
cd ..
st fused_tests
cuda_tests tests/ops/test_gated_delta_fused.py
pack
st done
