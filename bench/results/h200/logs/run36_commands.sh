# device call of session 9's fourth machine (committed as bench/results/h200/logs/run36_commands.sh):
# the shipped default (input_grads' q / k products on tensor cores, prepare on FMA loops: each
# kernel's source ran in run 35, this combination had not): the CUDA tests of the chunk kernels
# and the op's precision (TF32 off), then fla and chunkscan side by side (the file).
# Outputs in $OUT/run36.tgz.
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1
S=/tmp/so; mkdir -p $S
pack() { tar czf $OUT/run36.tgz -C $S . ; }
st tests
MLX_ENABLE_TF32=0 timeout 110 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py -k "cuda" \
  "tests/ops/test_gated_delta.py::test_low_precision_is_the_float32_call_rounded" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -8
pack
cd bench
st side_by_side
timeout 220 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --budget 200 --json $S/gdn_vs_fla_h200.json | grep -E "fla|chunkscan|rror"
pack
st done
