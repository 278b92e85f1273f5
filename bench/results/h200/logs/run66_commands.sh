# Session 20, after run 65: input_grads' row dots d_qg . q and d_kt . k (TF32 builds) from
# the values dq's and dk's epilogues load anyway (csg::tile_row_dots), d_g after dk.
# `bash <this> <part> <commit> <base commit>` (base: main before it, d35db96).
# part a: the CUDA tests; Nsight Compute's kernel times at 16384, new and base/.
# part b: fla and chunkscan side by side at 16384 and 65536, eager and compiled.
# Outputs in $OUT/run66<part>.tgz.
source bench/device_run.sh 66 "$@"  # st, $S, pack, cuda_tests, ncu_kernels, ncu_base, ...
if [ "$1" = a ]; then
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
else
  cd bench
  st fla
  fla_side_by_side
  pack
fi
st done
