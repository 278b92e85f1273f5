# Session 16, second machine: `bash <this> <commit> <base commit>` (base/ unused here).
# Nsight Compute at 16384 with the state pass's TF32 products on the mma.sync kernel (the
# new default) and on the wmma kernel (CHUNKSCAN_PASS_MMA=0, the kernel before); then the
# CUDA tests of both fused-kernel files. Outputs in $OUT/run54a.tgz.
source bench/device_run.sh 54 a "$@"  # st, $BASE, $S, pack, ncu_kernels, cuda_tests
cd bench
st ncu
ncu_kernels new
ncu_kernels wmma CHUNKSCAN_PASS_MMA=0
pack
cd ..
st tests
cuda_tests
pack
st done
