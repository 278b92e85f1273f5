# Session 17, second machine: `bash <this> <commit> <base commit>`, base/ = `git archive
# <base> src` (here c8ce348: dq back on the FMA Tile, an experiment) carried beside the tree.
# The CUDA tests of both fused-kernel files; the phase clocks (C = 64) of the tree, of base/
# and of the tree with CHUNKSCAN_GDN_NT=256 (input_grads at 256 threads; the others have
# 256 already); Nsight Compute's kernel times at 16384 of the tree and of base/.
# Outputs in $OUT/run57a.tgz.
source bench/device_run.sh 57 a "$@"  # st, $BASE, $S, pack, ncu_kernels, cuda_tests
st tests
cuda_tests
pack
cd bench
st profile
timeout 40 python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64_new.json 2>&1 | tail -1
timeout 40 $BASE python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64_base.json 2>&1 | tail -1
CHUNKSCAN_GDN_NT=256 timeout 40 python3 gdn_fused_kernels.py --profile --C 64 \
  --json $S/gdn_profile_C64_nt256.json 2>&1 | tail -1
pack
st ncu
ncu_kernels new 2>&1 | grep -v -E "Traceback|File|sys.exit|print|\^|BrokenPipe"
pack
BASE_ENV=${BASE#env }
ncu_kernels base $BASE_ENV 2>&1 | grep -v -E "Traceback|File|sys.exit|print|\^|BrokenPipe"
pack
st done
