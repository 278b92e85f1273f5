# Session 22, after the review: load_tile's 16-byte rounds and csg::TileLoad from one pair
# of helpers (issue16 / land16), input_grads' q / k finiteness test as one helper
# (csg::finite_input), the state pass's row copies (cs_copy_rows) and chunk scalars
# (stage_scalars, the first chunk's by cp.async too) each written once. Bitwise the values
# before in the emulator; the SASS differs (scheduling, registers).
# `bash <this> a <commit> <base commit>` (base: 7d8b8d7, the kernels of runs 72-74).
# The CUDA tests; Nsight Compute's kernel times at 16384, new and base/. Outputs in
# $OUT/run75a.tgz.
source bench/device_run.sh 75 "$@"  # st, $BASE, $S, pack, cuda_tests, ncu_kernels, ...
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
st done
