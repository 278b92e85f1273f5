# device call 2 of the second machine of session 7 (committed as
# bench/results/h200/logs/run25_commands.sh): `bash <this> <commit> <base>`, with base/ =
# `git archive <base> src` (the code before the session's glue cuts) carried beside it.
# CUDA tests; the op at 16384 before and after, in the same call; Nsight Compute's kernel
# times after; then fla and chunkscan side by side at 16384 and 65536 (the file).
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
st tests
MLX_ENABLE_TF32=0 timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py tests/test_precompile.py \
  tests/ops/test_gated_delta.py -k "cuda or non_finite or nan or inf" 2>&1 | tee $OUT/tests_h200_cuda.txt | tail -3
st ab16k
G="python3 gdn_vs_fla.py --T 16384 --repeats 5 --impls chunkscan --chunk-sizes 64"
cd bench
for m in compiled eager; do
  timeout 45 $G --modes $m --json $OUT/gdn_16k_${m}_h200.json | grep -E "chunkscan|rror"
  timeout 45 $BASE $G --modes $m --json $OUT/gdn_16k_${m}_base_h200.json | grep -E "chunkscan|rror"
done
st ncu
timeout 100 ncu --profile-from-start off --clock-control none --csv --page raw --section SpeedOfLight \
  --log-file $OUT/ncu_chunkscan_16k_sol.csv python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
python3 ncu_summary.py $OUT/ncu_chunkscan_16k_sol.csv --by-name | head -16
st side_by_side
timeout 250 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --budget 240 --json $OUT/gdn_vs_fla_h200.json | grep -E "fla|chunkscan|rror"
timeout 40 python3 gdn_vs_fla.py --T 16384 --impls chunkscan-portable --modes eager --chunk-sizes 128 \
  --repeats 3 --json $OUT/gdn_portable_16k_eager_h200.json | grep -E "chunkscan|rror"
st done
