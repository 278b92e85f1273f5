# one device call (not committed): the precompiled kernels' tests, first calls, the op beside fla, LoRA
source bench/device_setup.sh
R=$OUT; S=/tmp/so; mkdir -p $S
pack() { tar czf $R/run.tgz -C $S . ; }
st() { echo "=== $1 ($(date +%T))"; }
CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
export CHUNKSCAN_COMMIT=$1
export CHUNKSCAN_CUDA_CACHE=/tmp/c_tests
PYT="python3 -m pytest -q -s -p no:cacheprovider -rs"
st tests_precompile
MLX_ENABLE_TF32=0 timeout 110 $PYT tests/test_precompile.py tests/test_backend.py 2>&1 | tee $S/tests_h200_precompile.txt | tail -6
if grep -q "failed\|rror" $S/tests_h200_precompile.txt || ! grep -q "passed" $S/tests_h200_precompile.txt; then
  st tests_precompile_ptx
  CHUNKSCAN_CUDA_PRECOMPILE=ptx MLX_ENABLE_TF32=0 timeout 90 $PYT tests/test_precompile.py -k cuda 2>&1 \
    | tee $S/tests_h200_precompile_ptx.txt | tail -6
  if grep -q "1 passed" $S/tests_h200_precompile_ptx.txt; then export CHUNKSCAN_CUDA_PRECOMPILE=ptx; else export CHUNKSCAN_CUDA_PRECOMPILE=0; fi
fi
echo "CHUNKSCAN_CUDA_PRECOMPILE=${CHUNKSCAN_CUDA_PRECOMPILE:-default}"
MLX_ENABLE_TF32=0 timeout 100 $PYT tests/ops/test_gated_delta_fused.py -k cuda 2>&1 | tee $S/tests_h200_fused.txt | tail -3
ls /tmp/c_tests | wc -l
pack
st first_call
P=${CHUNKSCAN_CUDA_PRECOMPILE:-1}
for cfg in "0 mlx /tmp/c_unused" "$P cold /tmp/c_first" "$P warm /tmp/c_first"; do set -- $cfg
  (cd bench && CHUNKSCAN_CUDA_PRECOMPILE=$1 CHUNKSCAN_CUDA_CACHE=$3 timeout 70 python3 gdn_vs_fla.py --T 16384 \
    --impls chunkscan --modes eager --repeats 3 --json $S/gdn_first_call_$2_h200.json) | grep -E "chunkscan|rror"
done
pack
st gdn
export CHUNKSCAN_CUDA_CACHE=/tmp/c_first
(cd bench && timeout 200 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 32 --repeats 3 --budget 190 --json $S/gdn_vs_fla_h200.json) | grep -E "fla|chunkscan|rror"
pack
st lora
export CHUNKSCAN_CUDA_CACHE=/tmp/c_lora
L="python3 bench/lora.py --dtype bfloat16 --repeats 3 --config"
timeout 90 $L "$CFG" --timeout 85 --T 2048 --modes stub patched --json $S/lora_h200_2048_cold.json 2>&1 | tail -2
timeout 50 $L "$CFG" --timeout 45 --T 2048 --modes patched --json $S/lora_h200_2048_warm.json 2>&1 | tail -1
timeout 110 $L "$CFG" --timeout 100 --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -2
pack
st done
