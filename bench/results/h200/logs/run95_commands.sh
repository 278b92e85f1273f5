# Run 95 (session 30): the eager graph build trimmed (a call's backward takes the settings
# its forward read; no import per launch; the launch's binary key built from lists).
# On this project's CPU with the launches stubbed (mx.fast.precompiled_cuda_kernel
# returning lazy zeros) the build went from 0.33-0.34 ms to 0.28 at T = 16384. One call:
#   the CUDA tests of the fused chunk kernels and the rows (every launch goes through the
#   changed path) and attention's; the graph build with the real kernels, base (run 94's
#   code) against this code, alternately; the side by side at 16384 and 65536, two
#   samples; scan's second-derivative test on the GPU with TF32 off (three of the
#   first tests of tests/test_scan.py failed on the GPU, its default device, in run 94,
#   where MLX's float32 matmuls take TF32 by default).
# `bash <this> a <commit> <base commit>`. Outputs in $OUT/run95a.tgz.
source bench/device_run.sh 95 "$@"  # st, $BASE, $S, pack, fla_side_by_side, cuda_tests
st cuda_tests
cuda_tests tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_rows.py \
  tests/ops/test_attention_cuda.py
pack
st scan_gpu_tf32_off
MLX_ENABLE_TF32=0 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_scan.py \
  -k second_derivatives 2>&1 | tail -3 | tee $S/tests_h200_scan_second_tf32_off.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_scan.py -k second_derivatives \
  2>&1 | grep -E "passed|failed|max_rel|AssertionError" | tail -4 \
  | tee $S/tests_h200_scan_second_tf32_on.txt
pack
cd bench
st build
for i in 1 2; do
  $BASE python3 graph_build.py --T 16384 --repeats 100 --group-mib 16384 --real | tail -1 | sed 's/^/base: /'
  python3 graph_build.py --T 16384 --repeats 100 --group-mib 16384 --real | tail -1 | sed 's/^/new:  /'
done 2>&1 | tee $S/graph_build_h200.txt
pack
for i in 1 2; do
  st "side_by_side_$i"
  fla_side_by_side
  mv $S/gdn_vs_fla_h200.json $S/gdn_vs_fla_16384_65536_h200_s$i.json
  pack
done
st done
