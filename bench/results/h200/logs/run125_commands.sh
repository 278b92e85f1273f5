# Run 125 (session 47): on a GPU, what sessions 45-47 changed that no GPU has run yet,
# then (on an H200 only) issue 9's figures. After the set-up call,
# `bash <this> <part> <commit> 1b133f9` (base/ is not used); outputs in $OUT/run125<part>.tgz:
#   a: scan's rule 5 (each chunk's input slices wait for the incoming carry, session 46)
#      through the ops that use scan on a GPU: tests/test_scan.py and the dplr, selective
#      scan and diagonal tests, memory tests aside (they are CPU-shaped); then session 45's
#      float64_on_cpu tests of tests/test_mlx_lm.py;
#   b, c: run 119's parts b and c (fla side by side and the portable path; the LoRA
#      step at 8192 and the first step at 2048): bench/results/h200/logs/run119_commands.sh,
#      whose outputs are $OUT/run119b.tgz and run119c.tgz (not run125<part>).
case "$1" in
b|c) exec bash bench/results/h200/logs/run119_commands.sh "$@" ;;
esac
source bench/device_run.sh 125 "$@"  # st, $S, pack
case "$RUN_PART" in
a)
  st scan_tests
  timeout 300 python3 -m pytest -q -p no:cacheprovider -k "not memory" tests/test_scan.py \
    tests/ops/test_dplr_delta.py tests/ops/test_selective_scan.py tests/ops/test_diagonal.py \
    2>&1 | tee $S/tests_gpu_scan_rule5.txt | tail -3
  pack
  st float64_on_cpu
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mlx_lm.py \
    -k "$(grep -A1 '^@float64_on_cpu' tests/test_mlx_lm.py | sed -n 's/^def \(test_[a-z0-9_]*\).*/\1/p' | paste -sd'|' | sed 's/|/ or /g')" \
    2>&1 | tee $S/tests_gpu_float64_on_cpu.txt | tail -3
  pack
  ;;
esac
st done
