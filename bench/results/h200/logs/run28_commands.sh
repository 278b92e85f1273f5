# device call of session 8's first machine (committed as bench/results/h200/logs/run28_commands.sh),
# on wip/tc-state-pass at affc349: the tensor-core state pass's first run on a GPU (suite stage
# tc_pass), then the op's CUDA and non-finite tests on the same code
export CHUNKSCAN_COMMIT=affc349; source bench/device_setup.sh && nvidia-smi --query-gpu=name,clocks.sm --format=csv && OUT=$OUT timeout 420 bash bench/h200_suite.sh tc_pass; echo "=== full op tests"; timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/ops/test_gated_delta.py -k "cuda or non_finite" 2>&1 | tail -5
