# device call of session 8's second machine (committed as bench/results/h200/logs/run29_commands.sh),
# on wip/tc-state-pass: the tensor cores' accumulation probe (bench/tc_probe.py), the
# tensor-core state pass with split accumulators (its CUDA tests, the pass beside the FMA
# kernel, Nsight Compute on both), then the op at 16384 with it
source bench/device_setup.sh >/dev/null 2>&1
export CHUNKSCAN_COMMIT=$1
python3 bench/tc_probe.py --out $OUT/tc_probe_h200.npz
CHUNKSCAN_PASS_TC=1 MLX_ENABLE_TF32=0 timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_passes.py -k cuda 2>&1 | tee $OUT/tests_h200_tc_pass.txt | grep -E "kernel-ref|passed|failed|Error" | tail -30
for tc in 0 1; do
  CHUNKSCAN_PASS_TC=$tc timeout 60 python3 bench/state_pass.py --n 256 --tr 16 --runs 7 \
    --skip-portable-above 0 --out $OUT/state_pass_tc${tc}_h200.json 2>&1 | grep -E "^\| kernel|rror"
done
FULL="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
FULL="$FULL --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
for tc in 0 1; do
  CHUNKSCAN_PASS_TC=$tc timeout 90 ncu --clock-control none --csv --page raw $FULL \
    --kernel-name regex:state_pass --log-file $OUT/ncu_state_pass_tc${tc}.csv \
    python3 bench/state_pass.py --n 256 --tr 16 --runs 1 --skip-portable-above 0 \
    --out /tmp/sp_ncu_$tc.json 2>&1 | tail -1
  python3 bench/ncu_summary.py $OUT/ncu_state_pass_tc${tc}.csv
done
for m in compiled eager; do
  (cd bench && CHUNKSCAN_PASS_TC=1 timeout 45 python3 gdn_vs_fla.py --T 16384 --repeats 5 \
    --impls chunkscan --chunk-sizes 64 --modes $m --json "$OUT/gdn_16k_${m}_tc_h200.json") \
    | grep -E "chunkscan|rror"
done
