# Prepared in session 13 for the next machine (committed as
# bench/results/h200/logs/run48_commands.sh; not run yet): `bash <this> <part> <commit> <base>`,
# base/ = `git archive <base> src` carried beside it.
# part a (the working tree at branch wip/doubling-unrolled, base/ = main): the CUDA tests
#   of both fused-kernel files; Nsight Compute's kernel times at 16384, new and base;
#   bench/gpu_gaps.py, new and base twice (the device's busy time, and how far into the
#   call the first kernel starts).
# part b (main): MLX's command-graph sizes, which the user sets for the process: the op
#   at 16384 and 65536 side by side with fla, and gpu_gaps at 16384, under the defaults,
#   MLX_MAX_MB_PER_BUFFER=64 and MLX_MAX_OPS_PER_BUFFER=20 (time, peak, the CPU's lead
#   before the first kernel).
# part c: the LoRA step at 8192 (1.66x the stub in run 44).
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
elif [ "$1" = b ]; then
  cd bench
  for ENV in "" "MLX_MAX_MB_PER_BUFFER=64" "MLX_MAX_OPS_PER_BUFFER=20"; do
    tag=${ENV:-default}; tag=${tag%%=*}
    st "buffers $ENV"
    env $ENV timeout 60 python3 gpu_gaps.py --T 16384 2>&1 | grep -E "^(eager|compiled)" | tee $S/gpu_gaps_$tag.txt
    for T in 16384 65536; do
      env $ENV timeout 150 python3 gdn_vs_fla.py --T $T --impls fla chunkscan --modes eager compiled \
        --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_${T}_${tag}_h200.json | grep -E "fla|chunkscan|rror"
      pack
    done
  done
else
  st lora
  CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
  timeout 300 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 280 \
    --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -3
  pack
fi
st done
