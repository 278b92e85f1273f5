#!/usr/bin/env bash
# Every H200 figure of the docs in one device call (this workplace: run after
# `source bench/device_setup.sh`; elsewhere, on any CUDA machine with chunkscan[cuda,lm]
# and fla-core installed, run the same lines). Writes into ${OUT:-bench-out}.
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
stage() { echo "=== $1 ($(date +%T))"; }
stage tests
MLX_ENABLE_TF32=0 timeout 80 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_passes.py tests/ops/test_attention.py \
  "tests/ops/test_gated_delta.py::test_fp32_matches_oracle" \
  "tests/ops/test_gated_delta.py::test_packed_sequences" 2>&1 | tee "$OUT/tests_h200.txt" | tail -4
stage gdn_vs_fla
(cd bench && timeout 175 python3 gdn_vs_fla.py --T 16384 65536 --modes eager compiled \
  --repeats 3 --budget 150 --json "$OUT/gdn_vs_fla_h200.json")
stage lora
LORA_CONFIG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
timeout 135 python3 bench/lora.py --T 2048 8192 32768 --modes patched stub patched+attn stub+attn \
  --repeats 2 --timeout 60 --config "$LORA_CONFIG" --json "$OUT/lora_h200.json" 2>&1 | tail -25
stage attention
timeout 80 python3 bench/attention.py ATTENTION_ARGS --json "$OUT/attention_h200.json" 2>&1 | tail -20
stage done
