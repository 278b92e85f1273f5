# one device call (committed as bench/results/h200/logs/run23_commands.sh): Nsight Compute
# on one fwd+bwd of chunkscan and of fla (bench/ncu_op.py), and the portable path compiled
source bench/device_setup.sh >/dev/null 2>&1
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_main
mkdir -p /tmp/so; pack() { tar czf $OUT/run.tgz -C /tmp/so .; }
ncu --version | tail -1; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
N="ncu --profile-from-start off --clock-control none --csv --page raw"
FULL="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
cd bench
# every kernel of one chunkscan call at 16384 (time only), then the chunk kernels in full at 4096
timeout 150 $N --section SpeedOfLight --log-file /tmp/so/ncu_chunkscan_16k_sol.csv python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -2
python3 ncu_summary.py /tmp/so/ncu_chunkscan_16k_sol.csv --by-name | head -30; pack
timeout 150 $N $FULL --kernel-name regex:chunkscan_ --log-file /tmp/so/ncu_chunkscan_4k_full.csv python3 ncu_op.py --impl chunkscan --T 4096 2>&1 | tail -2
python3 ncu_summary.py /tmp/so/ncu_chunkscan_4k_full.csv; pack
timeout 280 $N $FULL --log-file /tmp/so/ncu_fla_16k_full.csv python3 ncu_op.py --impl fla --T 16384 2>&1 | tail -2
python3 ncu_summary.py /tmp/so/ncu_fla_16k_full.csv --by-name | head -30; pack
timeout 200 python3 gdn_vs_fla.py --T 16384 --impls chunkscan-portable --modes compiled eager --chunk-sizes 128 --repeats 3 --json /tmp/so/gdn_portable_16k_h200.json | grep -E "chunkscan|rror"
pack
