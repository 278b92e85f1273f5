# Run 85 (session 25): the backward takes the last group's preparation from the forward
# (chunk.py's _KEEP_PREPARED, CHUNKSCAN_GDN_KEEP_PREPARED; <commit>) against main before
# it (2b24b2a's sources, base/: the same kernels). `bash <this> a <commit> <base commit>`.
# Stages: the new CUDA tests of the reuse; Nsight Compute new and base at 16384; fla side
# by side (16384 and 65536, eager and compiled, the peak memory); the CUDA tests of the
# chunk kernels' file. Outputs in $OUT/run85a.tgz.
source bench/device_run.sh 85 "$@"  # st, $BASE, $S, pack, ncu_kernels, ncu_base, ...
st tests_reuse
MLX_ENABLE_TF32=0 timeout 90 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py -k "reuses or keep_prepared" 2>&1 \
  | tee $S/tests_h200_cuda_reuse.txt | tail -3
pack
cd bench
st ncu
ncu_kernels new
pack
st ncu_base
ncu_base
pack
st fla
fla_side_by_side
pack
cd ..
st tests
MLX_ENABLE_TF32=0 timeout 170 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py -k "(cuda or tf32) and not emulated" \
  > $S/tests_h200_cuda_fused.txt 2>&1
grep -E "passed|failed|^FAILED|Error" $S/tests_h200_cuda_fused.txt | tail -6
pack
st done
