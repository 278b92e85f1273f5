# Run 89 (session 26). Run 88 found the compiled call's kernels taking longer on the GPU
# than the eager call's (bench/gpu_gaps.py, kernels back to back in both: span 9.31 ms
# against 8.39 at T = 16384, 40.70 against 36.39 at 65536). (1) Which kernels: gpu_gaps
# with --kernels 25 at both lengths. (2) The CUDA tests of the chunk kernels, passes and
# rows on this commit (the last code that ran them on the H200 was b2b34e3, run 86), the
# two test processes side by side.
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run89a.tgz.
source bench/device_run.sh 89 "$@"  # st, $S, pack
cd bench
st gaps
timeout 60 python3 gpu_gaps.py --T 16384 --kernels 25 2>&1 | grep -v -i warn | tee $S/gpu_gaps_16384.txt
timeout 90 python3 gpu_gaps.py --T 65536 --kernels 25 2>&1 | grep -v -i warn | tee $S/gpu_gaps_65536.txt
pack
cd ..
st tests
MLX_ENABLE_TF32=0 timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/ops/test_gated_delta_fused.py \
  -k "(cuda or tf32) and not emulated" > $S/tests_h200_cuda_fused.txt 2>&1 &
MLX_ENABLE_TF32=0 timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/ops/test_gated_delta_passes.py \
  tests/ops/test_gated_delta_rows.py tests/test_backend.py -k "(cuda or tf32 or backend) and not emulated" \
  > $S/tests_h200_cuda_passes_rows.txt 2>&1 &
wait
for f in $S/tests_h200_cuda_*.txt; do echo $f; grep -E "passed|failed|^FAILED|Error" $f | tail -6; done
pack
st done
