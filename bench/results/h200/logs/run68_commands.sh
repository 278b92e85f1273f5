# Session 21: prepare's inverse (csg::inverse_level: each thread R rows of one column of a
# doubling level, unrolled over the whole block; the forward substitution's column stored
# after its loads; K~ and k beta gamma 16 bytes at a time). Bitwise the values before in
# the emulator. `bash <this> a <commit> <base commit>` (base: main before it, d2f7e78).
# The CUDA tests; Nsight Compute's kernel times at 16384, new and base/; phase clocks;
# fla and chunkscan side by side at 16384 and 65536. Outputs in $OUT/run68a.tgz.
source bench/device_run.sh 68 "$@"  # st, $BASE, $S, pack, cuda_tests, ncu_kernels, ...
st tests
cuda_tests
pack
cd bench
st ncu
ncu_kernels new
pack
st ncu_base
ncu_base
pack
st profile
timeout 60 python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64.json 2>&1 \
  | grep -v CSPROF | head -6
pack
st fla
fla_side_by_side
pack
st done
