# device call 3 of session 7 (committed as bench/results/h200/logs/run24_commands.sh), right
# after run 23 on the same machine: Nsight Compute on one fla fwd+bwd at 16384 (its first call
# compiles and autotunes Triton's kernels, ~200 s on a fresh machine, outside the bracket)
source bench/device_setup.sh >/dev/null 2>&1
N="ncu --profile-from-start off --clock-control none --csv --page raw"
FULL="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
FULL="$FULL --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
cd bench
timeout 560 $N $FULL --log-file $OUT/ncu_fla_16k_full.csv python3 ncu_op.py --impl fla --T 16384 2>&1 | tail -3
python3 ncu_summary.py $OUT/ncu_fla_16k_full.csv --by-name | head -40
