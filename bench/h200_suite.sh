#!/usr/bin/env bash
# Every H200 figure of the docs in one device call. In this workplace run it after
# `source bench/device_setup.sh`; on any CUDA machine with `pip install -e
# '.[cuda,lm,test]' fla-core==0.6.0` run it as it is. Writes into ${OUT:-bench-out}.
# Each stage has a time limit so that the whole suite fits one 10-minute call.
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
stage() { echo "=== $1 ($(date +%T))"; }
stage tests  # TF32 off: the fp32 tolerances are those of exact fp32 matmuls
MLX_ENABLE_TF32=0 timeout 50 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_passes.py \
  "tests/ops/test_gated_delta.py::test_fp32_matches_oracle" \
  "tests/ops/test_gated_delta.py::test_packed_sequences" \
  tests/ops/test_attention.py 2>&1 | tee "$OUT/tests_h200.txt" | tail -4
stage gdn_vs_fla
(cd bench && timeout 125 python3 gdn_vs_fla.py --T 16384 65536 --modes eager compiled \
  --repeats 3 --budget 105 --json "$OUT/gdn_vs_fla_h200.json")
stage lora
CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
LORA="python3 bench/lora.py --repeats 2 --timeout 45 --config $(printf %q "$CFG") --json $OUT/lora_h200.json"
eval timeout 95 $LORA --T 2048 8192 --modes patched stub | tail -8
eval timeout 70 $LORA --merge --T 512 8192 32768 --modes patched+attn | tail -8
eval timeout 25 $LORA --merge --T 512 --modes patched | tail -8
stage attention
timeout 70 python3 bench/attention.py --shape qwen3-next --T 8192 16384 32768 65536 \
  --fast-max-T 16384 --repeats 3 --timeout 30 --json "$OUT/attention_h200.json" 2>&1 | tail -12
stage done
