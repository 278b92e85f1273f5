# device call of session 9's second machine (committed as bench/results/h200/logs/run34_commands.sh):
# 1. each chunk kernel alone, twice, with load_tile (new), with one element per load (scalar) and
#    as before (base/ = `git archive 0364e3a src`), interleaved: run 33 had input_grads 10% slower;
# 2. the tensor-core state pass's tiling sweep (suite stage tc_tune; its CUDA tests at 16 rows);
# 3. wip/stage-piece2 (stage/ = `git archive <it> src`: the state-pass kernels' staging as one
#    function): the pass CUDA tests, then the pass beside main's in the same call;
# 4. the LoRA step at T = 8192, patched against the stub (not rerun since session 5)
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
STAGE="env PYTHONPATH=$PWD/stage/src:$PYTHONPATH CHUNKSCAN_COMMIT=$3 CHUNKSCAN_CUDA_CACHE=/tmp/c_stage"
K="python3 bench/gdn_fused_kernels.py --tokens 4096 --C 64"
st kernels
for i in 1 2; do
  timeout 30 $K --json $OUT/gdn_fused_kernels_C64_new$i.json 2>&1 | tail -1
  CHUNKSCAN_GDN_SCALAR_LOADS=1 timeout 30 $K --json $OUT/gdn_fused_kernels_C64_scalar$i.json 2>&1 | tail -1
  timeout 30 $BASE $K --json $OUT/gdn_fused_kernels_C64_base$i.json 2>&1 | tail -1
done
st stage_piece
MLX_ENABLE_TF32=0 timeout 80 $STAGE python3 -m pytest -q -p no:cacheprovider \
  tests/ops/test_gated_delta_passes.py -k cuda 2>&1 | tee $OUT/tests_h200_stage_piece.txt | tail -1
for tc in 0 1; do
  for who in main stage; do
    W=""; [ $who = stage ] && W=$STAGE
    CHUNKSCAN_PASS_TC=$tc timeout 40 $W python3 bench/state_pass.py --n 256 --tr 16 --runs 7 \
      --skip-portable-above 0 --out $OUT/state_pass_tc${tc}_${who}.json 2>&1 | grep -E "^\| kernel|rror"
  done
done
st tc_tune
OUT=$OUT bash bench/h200_suite.sh tc_tune
st lora
CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
timeout 110 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 100 \
  --T 8192 --modes stub patched --json $OUT/lora_h200_8192.json 2>&1 | tail -2
st done
