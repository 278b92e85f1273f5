# one device call (committed as bench/results/h200/logs/run22_commands.sh): the final code's op
# beside fla at 16384 (what the README cites); each command writes straight into $OUT
source bench/device_setup.sh >/dev/null 2>&1
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_final
G="python3 gdn_vs_fla.py --T 16384 --repeats 3"
(cd bench && timeout 90 $G --impls fla chunkscan --modes eager --chunk-sizes 64 --json $OUT/gdn_vs_fla_16k_eager_h200.json) | grep -E "fla|chunkscan|rror"
(cd bench && timeout 90 $G --impls chunkscan --modes compiled --chunk-sizes 64 32 --json $OUT/gdn_vs_fla_16k_compiled_h200.json) | grep -E "chunkscan|rror"
