# Session 21, after run 69: output as it was (run 69 measured its two changes at nothing:
# OWN_W reverted, output_h's d_o through load_tile again); the other kernels as in run
# 69. `bash <this> a <commit> <commit>`.
# The CUDA tests; fla and chunkscan side by side at 16384 and 65536. Outputs in
# $OUT/run70a.tgz.
source bench/device_run.sh 70 "$@"  # st, $S, pack, cuda_tests, fla_side_by_side, ...
st tests
cuda_tests
pack
cd bench
st fla
fla_side_by_side
pack
st done
