# device calls 2 and 3 of session 11's second machine (committed as
# bench/results/h200/logs/run42_commands.sh): `bash <this> <part> <commit> <base>`, base/ =
# `git archive <base> src` (session 10's code, 861c1c7) carried beside it.
# part a: the CUDA tests (MLX's TF32 off, the TF32 tests forcing ours on); the op at 16384
#   against base in the same call, twice each; Nsight Compute's per-instruction warp-stall
#   samples (SourceCounters) of state_grads, output and input_grads at T = 4096.
# part b: fla and chunkscan side by side at 16384 and 65536 (the file); the LoRA
#   step at 8192. Outputs in $OUT/run42<part>.tgz.
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$3 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
test -d base/src/chunkscan || echo "NO BASE"
S=/tmp/so42$1; mkdir -p $S
pack() { tar czf $OUT/run42$1.tgz -C $S . ; }
if [ "$1" = a ]; then
  st tests
  MLX_ENABLE_TF32=0 timeout 200 python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
    | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error|'o'" | tail -8
  pack a
  cd bench
  st op16k
  G="python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 --modes compiled eager"
  for i in 1 2; do
    timeout 40 $G --json $S/gdn_16k_new_$i.json | grep -E "chunkscan|rror"
    timeout 40 $BASE $G --json $S/gdn_16k_base_$i.json | grep -E "chunkscan|rror"
  done
  pack a
  st ncu_source
  timeout 150 ncu --profile-from-start off --clock-control none --section SourceCounters \
    --section WarpStateStats --kernel-name regex:"chunkscan_gdn_(state_grads|output|input_grads)" \
    --launch-count 3 -o $S/ncu_src python3 ncu_op.py --impl chunkscan --T 4096 2>&1 | tail -2
  ncu -i $S/ncu_src.ncu-rep --page source --csv --print-source sass > $S/ncu_src_sass.csv 2>&1
  ls -la $S; gzip -f $S/ncu_src_sass.csv; rm -f $S/ncu_src.ncu-rep
  pack a
else
  cd bench
  st side_by_side
  for T in 16384 65536; do
    timeout 150 python3 gdn_vs_fla.py --T $T --impls fla chunkscan --modes eager compiled \
      --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_${T}_h200.json | grep -E "fla|chunkscan|rror"
  done
  pack b
  cd ..
  st lora
  CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
  timeout 110 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 100 \
    --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -3
  pack b
fi
st done
