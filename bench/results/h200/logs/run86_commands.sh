# Run 86 (session 25): main with the kept preparation (run 85), the settings read once
# per call and the groups joined along axis 0 (<commit>), against base/ = 2b24b2a
# (session 24's end). `bash <this> a <commit> <base commit>`. Stages: the graph build
# with the real kernels, new and base (and cProfile's costliest functions of the new
# one); the kernels' span, gaps and first-kernel delay (bench/gpu_gaps.py) at 16384 and
# 65536; Nsight Compute of the copy kernels at 65536 (the groups' concatenations); fla
# side by side (16384 and 65536, eager and compiled); the chunk kernels' CUDA tests.
# Outputs in $OUT/run86a.tgz.
source bench/device_run.sh 86 "$@"  # st, $BASE, $S, pack, fla_side_by_side, ...
cd bench
st graph_build
for i in 1 2; do
  timeout 60 python3 graph_build.py --T 16384 --repeats 50 --real 2>&1 | tail -1
  timeout 60 $BASE python3 graph_build.py --T 16384 --repeats 50 --real 2>&1 | tail -1
done
timeout 60 python3 graph_build.py --T 16384 --repeats 50 --real --profile 25 > $S/graph_build_profile.txt 2>&1
head -40 $S/graph_build_profile.txt | tail -30
pack
st gaps
timeout 60 python3 gpu_gaps.py --T 16384 2>&1 | grep -v -i warn | tee $S/gpu_gaps_16384.txt
timeout 90 python3 gpu_gaps.py --T 65536 2>&1 | grep -v -i warn | tee $S/gpu_gaps_65536.txt
pack
st ncu_copies64
timeout 120 ncu --profile-from-start off --clock-control none --csv --page raw \
  --section SpeedOfLight --kernel-name regex:copy --log-file $S/ncu_64k_copies.csv \
  python3 ncu_op.py --impl chunkscan --T 65536 2>&1 | tail -1
python3 ncu_summary.py $S/ncu_64k_copies.csv --by-name 2>&1 | head -8
gzip -f $S/ncu_64k_copies.csv
pack
st fla
fla_side_by_side
pack
cd ..
st tests
MLX_ENABLE_TF32=0 timeout 130 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py -k "(cuda or tf32) and not emulated" \
  > $S/tests_h200_cuda_fused.txt 2>&1
grep -E "passed|failed|^FAILED|Error" $S/tests_h200_cuda_fused.txt | tail -6
pack
st done
