# Session 21, first call: the CUDA tests of main as session 20 left it (633b071: its kept
# kernels as one set had no CUDA-test run of their own), then fresh phase clocks of the
# fused kernels and their one-by-one times at one group of 4096 tokens.
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run67a.tgz.
source bench/device_run.sh 67 "$@"  # st, $S, pack, cuda_tests, ...
st tests
cuda_tests
pack
cd bench
st profile
timeout 60 python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64.json 2>&1 | tail -30
pack
st kernels
timeout 90 python3 gdn_fused_kernels.py --C 64 --json $S/gdn_fused_kernels_C64.json 2>&1 | tail -20
pack
st done
