# one device call (committed as bench/results/h200/logs/run21_commands.sh): the chunk kernels after
# run 20's lessons (16-byte stores of the register blocks, state_grads' w/kt slices over v_new/d_vnew:
# C = 32 twice per multiprocessor) beside base/ (= `git archive <base> src`, the kernels before this
# session) in the same call: CUDA tests, each kernel alone, TV 32 vs 64, the state pass's row tile
# at a group's 64 chunks, the op at 16384 beside fla
source bench/device_setup.sh
R=$OUT; S=/tmp/so; mkdir -p $S
pack() { tar czf $R/run.tgz -C $S . ; }
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
st tests
MLX_ENABLE_TF32=0 timeout 90 python3 -m pytest -q -s -p no:cacheprovider -rs tests/ops/test_gated_delta_fused.py \
  tests/ops/test_gated_delta_passes.py tests/test_precompile.py -k "cuda" 2>&1 | tee $S/tests_h200_cuda.txt | tail -3
pack
st kernels
K="python3 bench/gdn_fused_kernels.py --tokens 4096"
for C in 64 32; do
  timeout 30 $K --C $C --json $S/gdn_fused_kernels_C${C}_h200.json 2>&1 | tail -1
  timeout 30 $BASE $K --C $C --json $S/gdn_fused_kernels_C${C}_base_h200.json 2>&1 | tail -1
  CHUNKSCAN_GDN_TV=32 timeout 30 $K --C $C --json $S/gdn_fused_kernels_C${C}_tv32_h200.json 2>&1 | tail -1
done
pack
st pass64
timeout 40 python3 bench/state_pass.py --n 64 --tr 16 32 --runs 7 --skip-portable-above 0 --out $S/state_pass_n64_h200.json 2>&1 | grep "^| kernel"
pack
st gdn16k
G="python3 gdn_vs_fla.py --T 16384 --repeats 3"
(cd bench && timeout 80 $G --impls fla chunkscan --modes eager --chunk-sizes 64 --json $S/gdn_vs_fla_16k_eager_h200.json) | grep -E "fla|chunkscan|rror"
(cd bench && timeout 80 $G --impls chunkscan --modes compiled --chunk-sizes 64 32 --json $S/gdn_vs_fla_16k_compiled_h200.json) | grep -E "chunkscan|rror"
(cd bench && timeout 45 $BASE $G --impls chunkscan --modes compiled --chunk-sizes 64 --json $S/gdn_vs_fla_16k_compiled_base_h200.json) | grep -E "chunkscan|rror"
pack
st done
