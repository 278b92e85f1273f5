# one device call (not committed as is: bench/results/h200/logs/run19_commands.sh): CUDA tests on main
# after the review refactors; save_states x chunk size beside fla at 16384; the portable path; LoRA C=32
source bench/device_setup.sh
R=$OUT; S=/tmp/so; mkdir -p $S
pack() { tar czf $R/run.tgz -C $S . ; }
st() { echo "=== $1 ($(date +%T))"; }
CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_all
PYT="python3 -m pytest -q -s -p no:cacheprovider -rs"
st tests
MLX_ENABLE_TF32=0 timeout 150 $PYT tests/test_precompile.py tests/test_backend.py tests/ops/test_gated_delta_fused.py \
  tests/ops/test_gated_delta_passes.py -k "cuda or precompile or backend" 2>&1 | tee $S/tests_h200_cuda.txt | tail -4
pack
st gdn16k
(cd bench && timeout 170 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 32 --save chunks groups --repeats 3 --budget 165 --json $S/gdn_vs_fla_16k_save_h200.json) | grep -E "fla|chunkscan|rror"
pack
st portable
(cd bench && timeout 70 python3 gdn_vs_fla.py --T 16384 --impls chunkscan-portable --modes eager compiled \
  --repeats 3 --budget 65 --json $S/gdn_portable_16k_h200.json) | grep -E "chunkscan|rror"
pack
st lora
L="python3 bench/lora.py --dtype bfloat16 --repeats 3 --config"
timeout 75 $L "$CFG" --timeout 70 --T 8192 --modes stub patched --json $S/lora_h200_8192_c64.json 2>&1 | tail -2
timeout 50 $L "$CFG" --timeout 45 --T 8192 --modes patched --chunk-size 32 --json $S/lora_h200_8192_c32.json 2>&1 | tail -1
pack
st pass_tr
timeout 60 python3 bench/state_pass.py --n 256 --tr 8 16 32 --runs 5 --skip-portable-above 0 --out $S/state_pass_tr_h200.json 2>&1 | tail -8
pack
st done
