# Prepared in session 24 for the next session's first call (not run: this session's device
# time was spent). Where the time beyond the kernels goes, on main's kernels (bc385b6's
# but for comments): compiled runs ~0.9 ms above the kernels' sum at 16384 and ~5 ms above
# four times it at 65536 (41.5-41.8 ms against 4 x 9.10); eager 2.2 ms above compiled on
# runs 80-81's machine. Part a: the graph build on the device's CPU, the kernels' span,
# busy time, gaps and first-kernel delay (bench/gpu_gaps.py) at 16384 and 65536, Nsight
# Compute's kernel times at 65536. Part b: the stall and bank-conflict counters of the
# three largest kernels at 16384 (`python3 bench/ncu_source_summary.py [--bank-conflicts]
# <csv>`). `bash <this> a|b <commit> <commit>`. Outputs in $OUT/run83<part>.tgz.
source bench/device_run.sh 83 "$@"  # st, $S, pack, source_counters
cd bench
if [ "$RUN_PART" = a ]; then
  st graph_build
  timeout 60 python3 graph_build.py --T 16384 --repeats 50 2>&1 | tail -2
  st gaps16
  timeout 150 python3 gpu_gaps.py --T 16384 2>&1 | tee $S/gpu_gaps_16384.txt | tail -12
  pack
  st gaps64
  timeout 200 python3 gpu_gaps.py --T 65536 2>&1 | tee $S/gpu_gaps_65536.txt | tail -12
  pack
  st ncu64
  timeout 200 ncu --profile-from-start off --clock-control none --csv --page raw \
    --section SpeedOfLight --log-file $S/ncu_64k_sol.csv \
    python3 ncu_op.py --impl chunkscan --T 65536 2>&1 | tail -1
  python3 ncu_summary.py $S/ncu_64k_sol.csv --by-name > $S/ncu_64k_summary.txt 2>&1
  head -12 $S/ncu_64k_summary.txt
  gzip -f $S/ncu_64k_sol.csv
  pack
else
  st source_counters
  source_counters "state_grads|input_grads|output" 4
  python3 ncu_source_summary.py --bank-conflicts --top 6 $S/ncu_src_cuda_sass.csv.gz
  python3 ncu_source_summary.py --top 6 $S/ncu_src_cuda_sass.csv.gz
  pack
fi
st done
