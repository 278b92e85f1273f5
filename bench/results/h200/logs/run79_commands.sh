# Session 24, run 79: the tensor-core products' tiles spread where an operand is read
# down its columns (csg::tile_pos: two lanes to a shared-memory bank before, one now),
# against base/ = main before it (cd86120: run 78's kept prepare). The chunk kernels'
# CUDA tests (test_gated_delta_fused.py only: the state pass's kernel is unchanged; the
# three files ran past 300 s in run 78), Nsight Compute new and base.
# `bash <this> a <commit> cd86120`. Outputs in $OUT/run79a.tgz.
source bench/device_run.sh 79 "$@"  # st, $BASE, $S, pack, ncu_kernels, ncu_base
st tests
MLX_ENABLE_TF32=0 timeout 330 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py -k "(cuda or tf32) and not emulated" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -12
pack
cd bench
st ncu
ncu_kernels new
pack
st ncu_base
ncu_base
pack
st done
