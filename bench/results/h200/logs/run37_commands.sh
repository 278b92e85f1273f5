# device call of session 10's first machine (committed as bench/results/h200/logs/run37_commands.sh):
# TF32 products (CHUNKSCAN_GDN_TF32; auto = MLX's own float32 matmul precision, TF32 on CUDA
# unless MLX_ENABLE_TF32=0) in output, state_grads, input_grads and both state passes, against
# the float32 kernels (CHUNKSCAN_GDN_TF32=0) in the same call: the CUDA tests (fused kernels and
# passes, MLX's TF32 off, the TF32 tests forcing ours on), the op at 16384 twice each, the state
# pass forward / reverse per product form, the phase clocks, then fla and chunkscan side by side.
# Every output goes into $OUT/run37.tgz (a call returns at most 8 files).
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1
S=/tmp/so; mkdir -p $S
pack() { tar czf $OUT/run37.tgz -C $S . ; }
st tests
MLX_ENABLE_TF32=0 timeout 170 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error|e-0" | tail -14
pack
cd bench
st op16k
G="python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 --modes compiled eager"
for i in 1 2; do
  for tf in auto 0; do
    CHUNKSCAN_GDN_TF32=$tf timeout 45 $G --json $S/gdn_16k_tf32${tf}_$i.json | grep -E "chunkscan|rror"
  done
done
pack
st state_pass
for v in "1 1" "0 1" "0 0"; do
  set -- $v
  echo "--- CHUNKSCAN_GDN_TF32=$1 CHUNKSCAN_PASS_TC=$2"
  CHUNKSCAN_GDN_TF32=$1 CHUNKSCAN_PASS_TC=$2 timeout 40 python3 state_pass.py --n 256 --runs 7 \
    --skip-portable-above 0 --out $S/state_pass_tf32$1_tc$2.json 2>&1 | grep -vE "^\s*$" | tail -4
done
pack
st profile
CHUNKSCAN_GDN_TF32=1 timeout 30 python3 gdn_fused_kernels.py --profile --C 64 \
  --json $S/gdn_profile_C64_tf32.json 2>&1 | tail -1
pack
st side_by_side
timeout 200 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --budget 190 --json $S/gdn_vs_fla_h200.json | grep -E "fla|chunkscan|rror"
pack
st done
