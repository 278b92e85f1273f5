# Run 119 (session 42): the rows kernel's CUDA tests after _non_finite_reach took
# beta=None (the kernel branch's condition changed; Gated DeltaNet always passes beta).
# After the set-up call, `bash <this> a <commit> 1b133f9`; outputs in $OUT/run119a.tgz.
source bench/device_run.sh 119 "$@"  # st, $S, pack, cuda_tests
st tests
cuda_tests tests/ops/test_gated_delta_rows.py
pack
st done
