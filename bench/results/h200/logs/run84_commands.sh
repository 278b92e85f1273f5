# Run 84 (session 25): session 24's prepared kernel changes (265157a: cs_copy_rows in the
# shared CP_ASYNC header, cs_ldsm4_tf32<ROUND>; ea257b8: a piece's stores into shared
# memory rotated by its (first column / 32)), re-applied on main by 58a0186, against
# main before them (2b24b2a, base/), and where the time beyond the kernels goes (what
# session 24 prepared as run 83, part a). `bash <this> a <commit> <base commit>`.
# Stages, the most wanted first (a call that runs past its limit keeps what it packed):
# Nsight Compute new and base at 16384; the graph build on the device's CPU; the kernels'
# span, busy time, gaps and first-kernel delay (bench/gpu_gaps.py) at 16384 and 65536;
# Nsight Compute's kernel times at 65536; the CUDA tests of the three kernel files, the
# chunk kernels' file and the other two in two processes side by side (run 78's three
# files in one process took past 300 s on a fresh machine, mostly NVRTC compiles).
# Outputs in $OUT/run84a.tgz.
source bench/device_run.sh 84 "$@"  # st, $BASE, $S, pack, ncu_kernels, ncu_base
cd bench
st ncu
ncu_kernels new
pack
st ncu_base
ncu_base
pack
st graph_build
timeout 60 python3 graph_build.py --T 16384 --repeats 50 2>&1 | tail -2
st gaps16
timeout 90 python3 gpu_gaps.py --T 16384 2>&1 | tee $S/gpu_gaps_16384.txt | tail -12
pack
st gaps64
timeout 120 python3 gpu_gaps.py --T 65536 2>&1 | tee $S/gpu_gaps_65536.txt | tail -12
pack
st ncu64
timeout 150 ncu --profile-from-start off --clock-control none --csv --page raw \
  --section SpeedOfLight --log-file $S/ncu_64k_sol.csv \
  python3 ncu_op.py --impl chunkscan --T 65536 2>&1 | tail -1
python3 ncu_summary.py $S/ncu_64k_sol.csv --by-name > $S/ncu_64k_summary.txt 2>&1
head -12 $S/ncu_64k_summary.txt
gzip -f $S/ncu_64k_sol.csv
pack
cd ..
st tests
K="(cuda or tf32) and not emulated"
MLX_ENABLE_TF32=0 timeout 240 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py -k "$K" > $S/tests_h200_cuda_fused.txt 2>&1 &
MLX_ENABLE_TF32=0 timeout 240 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_passes.py tests/ops/test_gated_delta_rows.py -k "$K" \
  > $S/tests_h200_cuda_passes_rows.txt 2>&1 &
wait
for f in $S/tests_h200_cuda_*.txt; do echo "$f"; grep -E "passed|failed|^FAILED|Error" "$f" | tail -6; done
pack
st done
