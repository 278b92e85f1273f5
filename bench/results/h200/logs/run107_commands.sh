# Run 107 (session 38): the final code's fused-kernel and rows CUDA tests, after the
# review fixes (input_grads' thread rule by slices of Dv, 128995d / e678fb2; the kernel
# sources changed in comments only since run 106). After the set-up call, `bash <this> a
# <commit> aa3bd86` (the commit written out); outputs in $OUT/run107a.tgz.
source bench/device_run.sh 107 "$@"  # st, $S, pack, cuda_tests
st tests
cuda_tests tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_rows.py
pack
st done
