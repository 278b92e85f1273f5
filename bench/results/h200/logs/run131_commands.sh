# Run 131 (session 51). After the set-up call, `bash <this> <part> <commit> 1b133f9`;
# outputs in $OUT/run131<part>.tgz (part a) or $OUT/run119<part>.tgz (b, c):
#   a: what session 51 changed that runs on the GPU, memory tests aside: selective_scan's
#      tests (D x inside the chunk, D a float32 parameter), attention's (stream=) and the
#      mlx-lm seam's Mamba and Gated DeltaNet option tests;
#   b, c: run 119's parts b and c (fla side by side at 16384 and 65536 and the portable
#      path; the LoRA step at 8192 and the first step at 2048):
#      bench/results/h200/logs/run119_commands.sh.
case "$1" in
b|c) exec bash bench/results/h200/logs/run119_commands.sh "$@" ;;
esac
source bench/device_run.sh 131 "$@"  # st, $S, pack
case "$RUN_PART" in
a)
  st session51_tests
  timeout 400 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -k "not memory" \
    tests/ops/test_selective_scan.py tests/ops/test_attention.py \
    "tests/test_mlx_lm.py::test_an_unknown_option_raises_in_training_as_stock" \
    "tests/test_mlx_lm.py::test_per_channel_gate_runs_the_op" \
    2>&1 | tee $S/tests_gpu_session51.txt | tail -15
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_mlx_lm.py \
    -k "mamba and not memory" 2>&1 | tee $S/tests_gpu_session51_mamba_seam.txt | tail -4
  pack
  ;;
esac
st done
