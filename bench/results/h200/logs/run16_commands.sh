# one device call (not committed): main's checks and trade-offs, then wip/shared-loads' kernels
source bench/device_setup.sh
R=$OUT; S=/tmp/so; mkdir -p $S/main $S/sl
pack() { tar czf $R/run.tgz -C $S . ; }
st() { echo "=== $1 ($(date +%T))"; }
CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
export CHUNKSCAN_COMMIT=$1
st tests_main
MLX_ENABLE_TF32=0 timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rs tests/test_backend.py \
  tests/ops/test_gated_delta_fused.py -k "cuda or driver or supports or dispatch or scratch" 2>&1 \
  | tee $S/main/tests_h200_fused_backend.txt | tail -5
pack
st gdn_save
(cd bench && timeout 110 python3 gdn_vs_fla.py --T 65536 --impls chunkscan --modes eager \
  --save chunks groups --memory-limit-mib 0 1024 --repeats 3 --budget 100 \
  --json $S/main/gdn_save_65536_h200.json) | grep -E "chunkscan|rror"
(cd bench && timeout 60 python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes eager \
  --save chunks groups --repeats 3 --budget 55 --json $S/main/gdn_save_16384_h200.json) | grep -E "chunkscan|rror"
pack
st group_mib
(cd bench && timeout 80 python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes eager \
  --group-mib 1024 4096 --repeats 3 --budget 75 --json $S/main/gdn_group_mib_h200.json) | grep -E "chunkscan|rror"
pack
st lora2048
timeout 80 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 75 \
  --T 2048 --modes stub patched --json $S/main/lora_h200_2048.json 2>&1 | tail -4
pack
st shared_loads
cp wip_chunk_cuda_shared.py src/chunkscan/ops/gated_delta/_chunk_cuda.py
export CHUNKSCAN_COMMIT=$2
(OUT=$S/sl timeout 150 bash bench/h200_suite.sh fused profile_default)
pack
st done
