# one device call (not committed): every CUDA test with the precompiled kernels; memory floor; LoRA save modes
source bench/device_setup.sh
R=$OUT; S=/tmp/so; mkdir -p $S
pack() { tar czf $R/run.tgz -C $S . ; }
st() { echo "=== $1 ($(date +%T))"; }
CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_all
(OUT=$S timeout 280 bash bench/h200_suite.sh tests) 2>&1 | grep -v "^$" | tail -12
pack
st memfloor
(cd bench && timeout 100 python3 gdn_vs_fla.py --T 65536 --impls chunkscan --modes eager --save chunks groups \
  --group-mib 256 1024 --memory-limit-mib 1024 --repeats 3 --budget 95 --json $S/gdn_memfloor_65536_h200.json) | grep -E "chunkscan|rror"
pack
st lora_save
L="python3 bench/lora.py --dtype bfloat16 --repeats 3 --config"
timeout 70 $L "$CFG" --timeout 65 --T 8192 --modes stub patched --json $S/lora_h200_8192_save.json 2>&1 | tail -1
CHUNKSCAN_GDN_SAVE=groups timeout 50 $L "$CFG" --timeout 45 --T 8192 --modes patched --json $S/lora_h200_8192_save_groups.json 2>&1 | tail -1
timeout 80 $L "$CFG" --timeout 75 --T 32768 --modes patched+attn --json $S/lora_h200_32768.json 2>&1 | tail -1
CHUNKSCAN_GDN_SAVE=groups timeout 80 $L "$CFG" --timeout 75 --T 32768 --modes patched+attn --json $S/lora_h200_32768_save_groups.json 2>&1 | tail -1
pack
st done
