# device call of session 8's fifth machine (committed as bench/results/h200/logs/run32_commands.sh),
# with the device time left: the shipped default (tensor cores for the forward state pass only,
# CHUNKSCAN_PASS_TC unset): the CUDA tests of the op's kernels, then the op at 16384
source bench/device_setup.sh >/dev/null 2>&1
export CHUNKSCAN_COMMIT=$1
MLX_ENABLE_TF32=0 timeout 70 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda and not tc" 2>&1 \
  | tee $OUT/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -8
cd bench && timeout 50 python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan \
  --chunk-sizes 64 --modes compiled eager --json $OUT/gdn_16k_h200.json | grep -E "chunkscan|rror"
