# device call of session 8's fourth machine (committed as bench/results/h200/logs/run31_commands.sh):
# the tensor-core state pass with its scalars and H read ahead: the CUDA tests of the pass and of
# the op on its kernels; the pass with it off and on; fla and chunkscan side by side at 16384
# and 65536 (the file), then the op at 16384 with CHUNKSCAN_PASS_TC=0 in the same call
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1
st tests
MLX_ENABLE_TF32=0 timeout 110 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_passes.py tests/ops/test_gated_delta_fused.py -k cuda 2>&1 \
  | tee $OUT/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -8
st pass
for tc in 0 1; do
  CHUNKSCAN_PASS_TC=$tc timeout 40 python3 bench/state_pass.py --n 256 --tr 16 --runs 7 \
    --skip-portable-above 0 --out $OUT/state_pass_tc${tc}_h200.json 2>&1 | grep -E "^\| kernel|rror"
done
cd bench
st side_by_side
timeout 250 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --budget 230 --json $OUT/gdn_vs_fla_h200.json | grep -E "fla|chunkscan|rror"
st fma16k
CHUNKSCAN_PASS_TC=0 timeout 45 python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan \
  --chunk-sizes 64 --modes compiled eager --json $OUT/gdn_16k_tc0_h200.json | grep -E "chunkscan|rror"
st done
