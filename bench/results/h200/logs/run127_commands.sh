# Run 127 (session 49): session 49's changes on a GPU, then, on an H200 (none since run
# 105), issue 9's figures. After the set-up call, `bash <this> <part> <commit> 1b133f9`;
# outputs in $OUT/run127a.tgz (part a) or $OUT/run119<part>.tgz (b, c):
#   a: what session 49 changed, on the GPU: selective_scan's tests (A cast before the
#      scan), attention's (naive_attention's constant mask, the knob checks), scan's
#      capture and replaced-parameter tests, and the mlx-lm attention seam's routing;
#      memory tests aside, stopping at the first failure with its report;
#   b, c: run 119's parts b and c (fla side by side and the portable path; the LoRA step
#      at 8192 and the first step at 2048): bench/results/h200/logs/run119_commands.sh.
case "$1" in
b|c) exec bash bench/results/h200/logs/run119_commands.sh "$@" ;;
esac
source bench/device_run.sh 127 "$@"  # st, $S, pack
case "$RUN_PART" in
a)
  st session49
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider -rf --tb=short -k "not memory" \
    tests/ops/test_selective_scan.py tests/ops/test_attention.py \
    "tests/test_scan.py::test_a_module_the_params_module_s_call_reads_warns" \
    "tests/test_scan.py::test_one_block_under_two_names_is_no_replacement" \
    tests/test_mlx_lm.py::test_float64_attention_and_numpy_scales_go_to_stock \
    tests/test_mlx_lm.py::test_attention_with_cache_or_sinks_goes_to_stock \
    2>&1 | tee $S/tests_gpu_session49.txt | tail -15
  pack
  ;;
esac
st done
