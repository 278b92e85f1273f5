# device call 2 of session 10's second machine (committed as bench/results/h200/logs/run39_commands.sh),
# after run 38: `bash <this> <commit> <base>`, base/ = `git archive <base> src` carried beside it
# (run 38's base/ was not carried: its "base" rows ran the new code). The op at 16384 against
# base (run 37's code) in the same call, the LoRA step at 8192, fla and chunkscan side by side
# (the file), the phase clocks. Outputs in $OUT/run39.tgz.
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
test -d base/src/chunkscan || echo "NO BASE"
S=/tmp/so39; mkdir -p $S
pack() { tar czf $OUT/run39.tgz -C $S . ; }
st op16k
cd bench
G="python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 --modes compiled eager"
for i in 1 2; do
  timeout 40 $G --json $S/gdn_16k_new_$i.json | grep -E "chunkscan|rror"
  timeout 40 $BASE $G --json $S/gdn_16k_base_$i.json | grep -E "chunkscan|rror"
done
cd ..
pack
st lora
CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
timeout 100 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 90 \
  --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -2
pack
cd bench
st side_by_side
timeout 190 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --budget 180 --json $S/gdn_vs_fla_h200.json | grep -E "fla|chunkscan|rror"
pack
st profile
timeout 25 python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64.json 2>&1 | tail -1
pack
st done
