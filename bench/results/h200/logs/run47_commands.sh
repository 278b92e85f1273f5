# device calls 2 and 3 of session 13's second machine (committed as
# bench/results/h200/logs/run47_commands.sh): `bash <this> <part> <commit> <base>`, base/ =
# `git archive <base> src` carried beside it (e6f3491: main before session 13's kernels).
# part a: the CUDA tests of both fused-kernel files (MLX's TF32 off, the TF32 tests
#   forcing ours on); the op at 16384, new then base, twice; Nsight Compute's kernel
#   times of one fwd+bwd at 16384, new and base; the source counters of prepare (new,
#   line information, the cuda,sass page).
# part b: fla and chunkscan side by side at 16384 and 65536 (the file); the LoRA
#   step at 8192. Outputs in $OUT/run47<part>.tgz.
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$3 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
test -d base/src/chunkscan || echo "NO BASE"
S=/tmp/so47$1; mkdir -p $S
pack() { tar czf $OUT/run47$1.tgz -C $S . ; }
if [ "$1" = a ]; then
  st tests
  MLX_ENABLE_TF32=0 timeout 230 python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
    | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -8
  pack a
  cd bench
  st op16k
  G="python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 --modes compiled eager"
  for i in 1 2; do
    timeout 45 $G --json $S/gdn_16k_new_$i.json | grep -E "chunkscan|rror"
    timeout 45 $BASE $G --json $S/gdn_16k_base_$i.json | grep -E "chunkscan|rror"
  done
  pack a
  st ncu
  for w in new base; do
    R=""; [ $w = base ] && R="$BASE"
    timeout 80 $R ncu --profile-from-start off --clock-control none --csv --page raw --section SpeedOfLight \
      --log-file $S/ncu_16k_sol_$w.csv python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
    python3 ncu_summary.py $S/ncu_16k_sol_$w.csv --by-name > $S/ncu_by_name_$w.txt 2>&1
    head -8 $S/ncu_by_name_$w.txt; gzip -f $S/ncu_16k_sol_$w.csv
    pack a
  done
  st ncu_source
  CHUNKSCAN_CUDA_LINEINFO=1 CHUNKSCAN_CUDA_CACHE=/tmp/c_li timeout 60 ncu --profile-from-start off \
    --clock-control none --section SourceCounters --import-source yes \
    --kernel-name regex:"chunkscan_gdn_prepare" --launch-count 1 \
    -o $S/ncu_src python3 ncu_op.py --impl chunkscan --T 4096 2>&1 | tail -1
  ncu -i $S/ncu_src.ncu-rep --page source --csv --print-source cuda,sass > $S/ncu_src_cuda_sass.csv 2>&1
  gzip -f $S/ncu_src_cuda_sass.csv; rm -f $S/ncu_src.ncu-rep
  pack a
else
  cd bench
  st side_by_side
  for T in 16384 65536; do
    timeout 200 python3 gdn_vs_fla.py --T $T --impls fla chunkscan --modes eager compiled \
      --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_${T}_h200.json | grep -E "fla|chunkscan|rror"
    pack b
  done
  cd ..
  st lora
  CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
  timeout 300 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 280 \
    --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -3
  pack b
fi
st done
