# device calls 2 and 3 of session 12's second machine (committed as
# bench/results/h200/logs/run44_commands.sh): `bash <this> <part> <commit> <base>`, base/ =
# `git archive <base> src` (42f8ae3: run 43's kernels) carried beside it.
# part a: the CUDA tests (MLX's TF32 off, the TF32 tests forcing ours on); the op at 16384,
#   the new code, then with CHUNKSCAN_GDN_PREPARE_TF32=0, with CHUNKSCAN_GDN_WHOLE_W=0, and
#   base, twice each in that order; Nsight Compute's kernel times of one fwd+bwd at 16384.
# part b: fla and chunkscan side by side at 16384 and 65536 (the file); the LoRA
#   step at 8192. Outputs in $OUT/run44<part>.tgz.
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$3 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
test -d base/src/chunkscan || echo "NO BASE"
S=/tmp/so44$1; mkdir -p $S
pack() { tar czf $OUT/run44$1.tgz -C $S . ; }
if [ "$1" = a ]; then
  st tests
  MLX_ENABLE_TF32=0 timeout 230 python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
    | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error|heads of 96" | tail -8
  pack a
  cd bench
  st op16k
  G="python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 --modes compiled eager"
  for i in 1 2; do
    timeout 60 $G --json $S/gdn_16k_new_$i.json | grep -E "chunkscan|rror"
    CHUNKSCAN_GDN_PREPARE_TF32=0 timeout 40 $G --json $S/gdn_16k_prep0_$i.json | grep -E "chunkscan|rror"
    CHUNKSCAN_GDN_WHOLE_W=0 timeout 40 $G --json $S/gdn_16k_wf0_$i.json | grep -E "chunkscan|rror"
    timeout 60 $BASE $G --json $S/gdn_16k_base_$i.json | grep -E "chunkscan|rror"
  done
  pack a
  st ncu
  timeout 80 ncu --profile-from-start off --clock-control none --csv --page raw --section SpeedOfLight \
    --log-file $S/ncu_16k_sol.csv python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
  python3 ncu_summary.py $S/ncu_16k_sol.csv --by-name > $S/ncu_by_name.txt 2>&1
  head -8 $S/ncu_by_name.txt; gzip -f $S/ncu_16k_sol.csv
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
  timeout 150 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 140 \
    --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -3
  pack b
fi
st done
