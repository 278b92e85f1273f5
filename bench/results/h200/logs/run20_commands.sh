# one device call (committed as bench/results/h200/logs/run20_commands.sh): the chunk kernels with
# register-blocked products (16-byte shared-memory reads), beside the same kernels before (base/ =
# `git archive <base> src`) in the same call; their CUDA tests; the op beside fla; LoRA; phase clocks
source bench/device_setup.sh
R=$OUT; S=/tmp/so; mkdir -p $S
pack() { tar czf $R/run.tgz -C $S . ; }
st() { echo "=== $1 ($(date +%T))"; }
CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
PYT="python3 -m pytest -q -s -p no:cacheprovider -rs"
st tests
MLX_ENABLE_TF32=0 timeout 130 $PYT tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py \
  tests/test_precompile.py -k "cuda" 2>&1 | tee $S/tests_h200_cuda.txt | tail -4
pack
st kernels
for C in 64 32; do
  timeout 40 python3 bench/gdn_fused_kernels.py --tokens 4096 --C $C --json $S/gdn_fused_kernels_C${C}_h200.json 2>&1 | tail -3
  timeout 40 $BASE python3 bench/gdn_fused_kernels.py --tokens 4096 --C $C --json $S/gdn_fused_kernels_C${C}_base_h200.json 2>&1 | tail -3
done
pack
st gdn16k
(cd bench && timeout 200 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 32 --repeats 3 --budget 190 --json $S/gdn_vs_fla_16k_h200.json) | grep -E "fla|chunkscan|rror"
pack
st base16k
(cd bench && timeout 50 $BASE python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes eager \
  --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_16k_base_h200.json) | grep -E "chunkscan|rror"
pack
st lora
timeout 80 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 75 --T 8192 \
  --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -2
pack
st gdn64k
(cd bench && timeout 110 python3 gdn_vs_fla.py --T 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --budget 105 --json $S/gdn_vs_fla_64k_h200.json) | grep -E "fla|chunkscan|rror"
pack
st profile
timeout 30 python3 bench/gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64_h200.json 2>&1 | tail -8
pack
st done
