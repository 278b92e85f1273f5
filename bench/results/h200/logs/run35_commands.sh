# device call of session 9's third machine (committed as bench/results/h200/logs/run35_commands.sh):
# prepare's and input_grads' q / k products on tensor cores (CHUNKSCAN_GDN_TC, default auto = on)
# against the FMA loops (CHUNKSCAN_GDN_TC=0) in the same call: the CUDA tests of the chunk kernels
# and of the op's precision (TF32 off), each kernel alone twice each, the op at 16384 twice each,
# then fla and chunkscan side by side. Every output goes into $OUT/run35.tgz (a call returns at
# most 8 files).
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1
S=/tmp/so; mkdir -p $S
pack() { tar czf $OUT/run35.tgz -C $S . ; }
st tests
MLX_ENABLE_TF32=0 timeout 150 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda" \
  "tests/ops/test_gated_delta.py::test_low_precision_is_the_float32_call_rounded" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -8
pack
st kernels
K="python3 bench/gdn_fused_kernels.py --tokens 4096 --C 64"
for i in 1 2; do
  for tc in 1 0; do
    CHUNKSCAN_GDN_TC=$tc timeout 30 $K --json $S/gdn_fused_kernels_C64_tc${tc}_$i.json 2>&1 | tail -1
  done
done
CHUNKSCAN_GDN_TC=1 timeout 30 python3 bench/gdn_fused_kernels.py --profile --C 64 \
  --json $S/gdn_profile_C64_tc1.json 2>&1 | tail -1
pack
cd bench
st op16k
G="python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 --modes compiled eager"
for i in 1 2; do
  for tc in 1 0; do
    CHUNKSCAN_GDN_TC=$tc timeout 45 $G --json $S/gdn_16k_tc${tc}_$i.json | grep -E "chunkscan|rror"
  done
done
pack
st side_by_side
timeout 230 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --budget 210 --json $S/gdn_vs_fla_h200.json | grep -E "fla|chunkscan|rror"
pack
st done
