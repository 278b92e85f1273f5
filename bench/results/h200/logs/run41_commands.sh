# device call 2 of session 11's first machine (committed as bench/results/h200/logs/run41_commands.sh):
# `bash <this> <commit> <base>`, base/ = `git archive <base> src` (session 10's code, 861c1c7)
# carried beside it. tc_run's k steps outermost (PER accumulator chains per warp; input_grads'
# kk, qk, m1 in one run): the CUDA tests (MLX's TF32 off, the TF32 tests forcing ours on); the op
# at 16384 against base in the same call, twice each; Nsight Compute's kernel times of one
# fwd+bwd at 16384 (new code); the phase clocks. Outputs in $OUT/run41.tgz.
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
test -d base/src/chunkscan || echo "NO BASE"
S=/tmp/so41; mkdir -p $S
pack() { tar czf $OUT/run41.tgz -C $S . ; }
st tests
MLX_ENABLE_TF32=0 timeout 170 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error|'o'" | tail -8
pack
cd bench
st op16k
G="python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 --modes compiled eager"
for i in 1 2; do
  timeout 40 $G --json $S/gdn_16k_new_$i.json | grep -E "chunkscan|rror"
  timeout 40 $BASE $G --json $S/gdn_16k_base_$i.json | grep -E "chunkscan|rror"
done
pack
st ncu
timeout 100 ncu --profile-from-start off --clock-control none --csv --page raw --section SpeedOfLight \
  --log-file $S/ncu_chunkscan_16k_sol.csv python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
python3 ncu_summary.py $S/ncu_chunkscan_16k_sol.csv --by-name | head -16
gzip -f $S/ncu_chunkscan_16k_sol.csv
pack
st profile
timeout 25 python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64.json 2>&1 | tail -1
pack
st done
