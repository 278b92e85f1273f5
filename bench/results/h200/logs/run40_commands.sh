# device call of session 10's third machine (committed as bench/results/h200/logs/run40_commands.sh):
# `bash <this> <commit>`. Nsight Compute's full sections (occupancy, warp stalls, schedulers,
# memory) for chunkscan's own kernels in one fwd+bwd at T = 4096 (one group), as session 7's
# run 23 did for the kernels of then: where the current (TF32) kernels stall.
source bench/device_setup.sh >/dev/null 2>&1
export CHUNKSCAN_COMMIT=$1
N="ncu --profile-from-start off --clock-control none --csv --page raw"
FULL="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
FULL="$FULL --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
cd bench
timeout 110 $N $FULL --kernel-name regex:chunkscan_ --log-file $OUT/ncu_chunkscan_4k_full.csv \
  python3 ncu_op.py --impl chunkscan --T 4096 2>&1 | tail -2
python3 ncu_summary.py $OUT/ncu_chunkscan_4k_full.csv 2>&1 | head -30
gzip -f $OUT/ncu_chunkscan_4k_full.csv
