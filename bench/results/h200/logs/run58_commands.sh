# Session 17, third machine: `bash <this> <commit>` (no base: run 57 measured f0c06b9, the
# code before, on this kind of machine). input_grads' epilogues compute every value before
# the first store (the loads of q, k, v no longer wait for the stores before them), and
# TcMM::store_out's 8-byte stores through PTX. The CUDA tests of both fused-kernel files,
# Nsight Compute's kernel times at 16384, the phase clocks (C = 64).
# Outputs in $OUT/run58a.tgz.
source bench/device_run.sh 58 a "$@" none  # st, $S, pack, ncu_kernels, cuda_tests
st tests
cuda_tests
pack
cd bench
st ncu
ncu_kernels new 2>&1 | grep -v -E "Traceback|File|sys.exit|print|\^|BrokenPipe"
pack
st profile
timeout 40 python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64_new.json 2>&1 | tail -1
pack
st done
