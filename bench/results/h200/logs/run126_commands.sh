# Run 126 (session 47, for the next GPU): run 125's part a cut down to fit, failures
# reported (run 125's scan stage ran into its limit, its one failure's report cut off).
# After the set-up call, `bash <this> <part> <commit> 1b133f9`; outputs in
# $OUT/run126<part>.tgz:
#   a: the flattening-wrapper test run 125 failed (made device-aware since), then the
#      ops that use scan (dplr, selective scan, diagonal), memory tests aside, stopping
#      at the first failure with its report;
#   b, c: run 119's parts b and c (fla side by side and the portable path; the LoRA
#      step at 8192 and the first step at 2048): bench/results/h200/logs/run119_commands.sh,
#      whose outputs are $OUT/run119b.tgz and run119c.tgz (not run126<part>).
case "$1" in
b|c) exec bash bench/results/h200/logs/run119_commands.sh "$@" ;;
esac
source bench/device_run.sh 126 "$@"  # st, $S, pack
case "$RUN_PART" in
a)
  st flattening_wrapper
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_scan.py \
    -k "flattening_wrapper" 2>&1 | tee $S/tests_gpu_flattening.txt | tail -15
  pack
  st scan_ops
  timeout 330 python3 -m pytest -q -x -p no:cacheprovider -rf --tb=short -k "not memory" \
    tests/ops/test_dplr_delta.py tests/ops/test_selective_scan.py tests/ops/test_diagonal.py \
    2>&1 | tee $S/tests_gpu_scan_ops.txt | tail -15
  pack
  ;;
esac
st done
