# device call of session 9's first machine (committed as bench/results/h200/logs/run33_commands.sh):
# the chunk kernels' global loads through csg::load_tile (16 bytes per load, four in flight per
# thread) beside base/ (= `git archive 0364e3a src`, the kernels before) in the same call: the CUDA
# tests of the chunk kernels; phase clocks and each kernel alone, new and base; the op at 16384, new,
# base, and new with one element per load; then fla and chunkscan side by side (the file)
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
st tests
MLX_ENABLE_TF32=0 timeout 110 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py -k "cuda" 2>&1 \
  | tee $OUT/tests_h200_fused.txt | grep -E "passed|failed|^FAILED|Error" | tail -8
st profile
K="python3 bench/gdn_fused_kernels.py"
timeout 40 $K --profile --C 64 --json $OUT/gdn_profile_C64_h200.json 2>&1 | tail -1
timeout 40 $BASE $K --profile --C 64 --json $OUT/gdn_profile_C64_base_h200.json 2>&1 | tail -1
st kernels
timeout 30 $K --tokens 4096 --C 64 --json $OUT/gdn_fused_kernels_C64_h200.json 2>&1 | tail -1
timeout 30 $BASE $K --tokens 4096 --C 64 --json $OUT/gdn_fused_kernels_C64_base_h200.json 2>&1 | tail -1
cd bench
st op16k
G="python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 --modes compiled eager"
timeout 45 $G --json $OUT/gdn_16k_h200.json | grep -E "chunkscan|rror"
timeout 45 $BASE $G --json $OUT/gdn_16k_base_h200.json | grep -E "chunkscan|rror"
CHUNKSCAN_GDN_SCALAR_LOADS=1 timeout 45 $G --json $OUT/gdn_16k_scalar_h200.json | grep -E "chunkscan|rror"
st side_by_side
timeout 230 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --budget 210 --json $OUT/gdn_vs_fla_h200.json | grep -E "fla|chunkscan|rror"
st done
