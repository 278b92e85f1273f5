# device call 2 of session 11's third machine (committed as bench/results/h200/logs/run43_commands.sh):
# `bash <this> <commit>`. The o_bad flags in shared memory (output, state_grads) and the float32
# scratch tiles through cp.async (csg::copy_tile): the fused kernels' CUDA tests (MLX's TF32 off, the TF32 tests forcing ours on); Nsight Compute's kernel
# times of one fwd+bwd at 16384; the op's non-finite tests on CUDA with what time is left.
# Outputs in $OUT/run43.tgz.
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
S=/tmp/so43; mkdir -p $S
pack() { tar czf $OUT/run43.tgz -C $S . ; }
st tests
MLX_ENABLE_TF32=0 timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py -k "cuda or tf32" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -6
pack
cd bench
st ncu
timeout 100 ncu --profile-from-start off --clock-control none --csv --page raw --section SpeedOfLight \
  --log-file $S/ncu_chunkscan_16k_sol.csv python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
python3 ncu_summary.py $S/ncu_chunkscan_16k_sol.csv --by-name > $S/ncu_by_name.txt 2>&1
head -8 $S/ncu_by_name.txt
gzip -f $S/ncu_chunkscan_16k_sol.csv
pack
cd ..
st non_finite
MLX_ENABLE_TF32=0 timeout 50 python3 -m pytest -q -p no:cacheprovider tests/ops/test_gated_delta.py \
  -k "non_finite" 2>&1 | tee $S/tests_h200_non_finite.txt | tail -2
pack
st done
