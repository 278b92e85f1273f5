# Run 106 (session 38): after run 105's one failure (test_cuda_tf32_heads_of_96: input_grads
# at 512 threads needed 184 registers there; e10a007 gives it 256 threads except where
# its loop fits 128 registers). After the set-up call, `bash <this> a <commit> aa3bd86`
# (the commit written out); outputs in $OUT/run106a.tgz:
#   the CUDA tests of the fused chunk kernels and of the rows (cuda_tests; TF32 off there,
#   input_grads on 256 threads, and on 512 in the TF32 tests at C = 64);
#   fla and chunkscan side by side at T = 16384 and 65536, three repeats
#   (fla_side_by_side).
source bench/device_run.sh 106 "$@"  # st, $S, pack, cuda_tests, fla_side_by_side
st tests
cuda_tests tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_rows.py
pack
cd bench
st side_by_side
fla_side_by_side
pack
st done
