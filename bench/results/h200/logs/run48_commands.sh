# Prepared in session 13, revised in session 14 before it ran:
# `bash <this> <part> <commit> <base>`, base/ = `git archive <base> src` carried beside it.
# part a (the working tree at branch wip/doubling-unrolled, base/ = main): the CUDA tests
#   of both fused-kernel files; Nsight Compute's kernel times at 16384, new and base;
#   bench/gpu_gaps.py, new and base twice (the device's busy time, how far into the
#   call the first kernel starts, how long the lazy graph takes to build).
# part b (main): the op under MLX's memory limit with save_states="groups" (the peak
#   MLX's in-flight command graphs leave, and its price in time), at 16384 and 65536;
#   MLX_MAX_MB_PER_BUFFER=64 (smaller command graphs, the user's process-wide setting):
#   gpu_gaps and the op at 16384; then the LoRA step at 8192 (1.66x the stub in run 44).
# Outputs in $OUT/run48<part>.tgz.
source bench/device_run.sh 48 "$@"  # st, $BASE, $S, pack
if [ "$1" = a ]; then
  st tests
  MLX_ENABLE_TF32=0 timeout 300 python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
    | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -8
  pack
  cd bench
  st ncu
  for w in new base; do
    R=""; [ $w = base ] && R="$BASE"
    timeout 90 $R ncu --profile-from-start off --clock-control none --csv --page raw --section SpeedOfLight \
      --log-file $S/ncu_16k_sol_$w.csv python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
    python3 ncu_summary.py $S/ncu_16k_sol_$w.csv --by-name > $S/ncu_by_name_$w.txt 2>&1
    head -8 $S/ncu_by_name_$w.txt; gzip -f $S/ncu_16k_sol_$w.csv
    pack
  done
  st gaps
  for i in 1 2; do
    timeout 60 python3 gpu_gaps.py --T 16384 2>&1 | grep -E "^(eager|compiled)" | sed 's/^/new  /'
    timeout 60 $BASE python3 gpu_gaps.py --T 16384 2>&1 | grep -E "^(eager|compiled)" | sed 's/^/base /'
  done | tee $S/gpu_gaps.txt
  pack
else
  cd bench
  st memlimit
  timeout 200 python3 gdn_vs_fla.py --T 16384 65536 --impls chunkscan --modes compiled eager \
    --chunk-sizes 64 --save groups --memory-limit-mib 0 1024 --repeats 3 \
    --json $S/gdn_memlimit_h200.json | grep -E "chunkscan|rror"
  pack
  st "MLX_MAX_MB_PER_BUFFER=64"
  export MLX_MAX_MB_PER_BUFFER=64
  timeout 60 python3 gpu_gaps.py --T 16384 2>&1 | grep -E "^(eager|compiled)" | tee $S/gpu_gaps_mb64.txt
  timeout 90 python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes compiled eager \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_mb64_16384_h200.json | grep -E "chunkscan|rror"
  unset MLX_MAX_MB_PER_BUFFER
  pack
  cd ..
  st lora
  CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
  timeout 270 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 250 \
    --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -3
  pack
fi
st done
