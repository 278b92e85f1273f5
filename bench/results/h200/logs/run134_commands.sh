# Run 134 (session 52; not run then, part a extended in session 53, part s54 added in
# session 54). After the set-up
# call, `bash <this> <part> <commit> 1b133f9`;
# outputs in $OUT/run134<part>.tgz (part a) or $OUT/run119<part>.tgz (b, c):
#   a: what sessions 52 and 53 changed that runs on the GPU, memory tests aside:
#      attention's tests (the blocked backward's scale in ds; session 53: float16's
#      products of p and ds with float32 operands, the mask dtype message),
#      checkpoint's (rule 5 on its arguments), scan's (its constant xs gated by rule 2
#      and passed to the vjp; session 53: every output through a Depends), the random
#      key's (session 53: tests/test_random.py), the initial-state gradient tests of
#      gated_delta_rule and dplr_delta_rule, and linear_attention's (its saved states
#      in ~sqrt(n) blocks);
#   s53: session 53's tests alone (a short call where little device time is left):
#      tests/test_random.py, attention's float16 and mask-dtype tests, scan's
#      stopped-first-output, two-places and random-key tests;
#   s54: session 54's tests alone (short): stepwise's shapeless compile at one step,
#      gated_delta_rule's l2_normalize at huge norms and its default chunk at small
#      key heads (on a CUDA GPU the default is the kernels' or 128, capped at 4 Dk),
#      the kernels' constant inputs used from a worker thread (on the GPU's stream);
#   bc: run 119's parts b and c one after the other in one call (fla side by side at
#      16384 and 65536 and the portable path; the LoRA step at 8192 and the first step
#      at 2048): bench/results/h200/logs/run119_commands.sh.
case "$1" in
b|c) exec bash bench/results/h200/logs/run119_commands.sh "$@" ;;
bc) shift; bash bench/results/h200/logs/run119_commands.sh b "$@"
    exec bash bench/results/h200/logs/run119_commands.sh c "$@" ;;
esac
source bench/device_run.sh 134 "$@"  # st, $S, pack
case "$RUN_PART" in
a)
  st session52_tests
  timeout 420 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -k "not memory" \
    tests/ops/test_attention.py tests/test_checkpoint.py tests/test_scan.py tests/test_random.py \
    "tests/ops/test_gated_delta.py::test_initial_state_gradient_at_model_heads" \
    "tests/ops/test_gated_delta.py::test_initial_state_gradient_at_a_small_key_head" \
    "tests/ops/test_dplr_delta.py::test_initial_state_gradient_at_rwkv7s_heads" \
    tests/ops/test_linear_attention.py \
    2>&1 | tee $S/tests_gpu_session52.txt | tail -15
  pack
  ;;
s53)
  st session53_tests
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_random.py \
    tests/ops/test_attention.py tests/test_scan.py \
    -k "random or key or sink_rows or mask_of_another or low_precision or float16 or stopped_first or two_places" \
    2>&1 | tee $S/tests_gpu_session53.txt | tail -15
  pack
  ;;
s54)
  st session54_tests
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_stepwise.py \
    tests/ops/test_gated_delta.py tests/ops/test_gated_delta_fused.py tests/test_backend.py \
    -k "shapeless or normalize or l2_normalize or small_key or default_chunk or another_thread" \
    2>&1 | tee $S/tests_gpu_session54.txt | tail -15
  pack
  ;;
esac
st done
