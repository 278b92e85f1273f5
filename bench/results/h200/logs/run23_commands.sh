# device call 2 of session 7 (committed as bench/results/h200/logs/run23_commands.sh): Nsight
# Compute on one chunkscan fwd+bwd (bench/ncu_op.py), then the portable path timed at 16384.
# Each output is written straight into $OUT.
source bench/device_setup.sh >/dev/null 2>&1
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_main
which ncu; ncu --version | tail -1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
N="ncu --profile-from-start off --clock-control none --csv --page raw"
FULL="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
FULL="$FULL --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
cd bench
# every kernel of one call at 16384 (times only)
timeout 170 $N --section SpeedOfLight --log-file $OUT/ncu_chunkscan_16k_sol.csv \
  python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -3
wc -l $OUT/ncu_chunkscan_16k_sol.csv
python3 ncu_summary.py $OUT/ncu_chunkscan_16k_sol.csv --by-name | head -40
# chunkscan's own kernels in full at 4096
timeout 170 $N $FULL --kernel-name regex:chunkscan_ --log-file $OUT/ncu_chunkscan_4k_full.csv \
  python3 ncu_op.py --impl chunkscan --T 4096 2>&1 | tail -3
python3 ncu_summary.py $OUT/ncu_chunkscan_4k_full.csv | head -40
# the portable path (kernels off) at 16384, after the launch cut of a794a60
timeout 200 python3 gdn_vs_fla.py --T 16384 --impls chunkscan-portable --modes compiled eager \
  --chunk-sizes 128 --repeats 3 --json $OUT/gdn_portable_16k_h200.json | grep -E "chunkscan|rror"
