# device call 2 of session 12's first machine (committed as
# bench/results/h200/logs/run43_commands.sh): `bash <this> <commit> <base>`, base/ =
# `git archive <base> src` (main's code) carried beside it. Branch wip/copy-tile: the
# o_bad flags in shared memory (output, state_grads) and the float32 scratch tiles through
# cp.async (csg::copy_tile).
# The fused kernels' and passes' CUDA tests (MLX's TF32 off, the TF32 tests forcing ours on);
# the op at 16384 against base in the same call, twice each; Nsight Compute's kernel times
# of one fwd+bwd at 16384, new then base; the op's non-finite tests on CUDA.
# Outputs in $OUT/run43.tgz.
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
test -d base/src/chunkscan || echo "NO BASE"
S=/tmp/so43; mkdir -p $S
pack() { tar czf $OUT/run43.tgz -C $S . ; }
st tests
MLX_ENABLE_TF32=0 timeout 200 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -6
pack
cd bench
st op16k
G="python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 --modes compiled eager"
for i in 1 2; do
  timeout 60 $G --json $S/gdn_16k_new_$i.json | grep -E "chunkscan|rror"
  timeout 60 $BASE $G --json $S/gdn_16k_base_$i.json | grep -E "chunkscan|rror"
done
pack
st ncu
N="ncu --profile-from-start off --clock-control none --csv --page raw --section SpeedOfLight"
timeout 80 $N --log-file $S/ncu_16k_sol_new.csv python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
timeout 80 $BASE $N --log-file $S/ncu_16k_sol_base.csv python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
for x in new base; do
  python3 ncu_summary.py $S/ncu_16k_sol_$x.csv --by-name > $S/ncu_by_name_$x.txt 2>&1
  echo "-- $x"; head -8 $S/ncu_by_name_$x.txt; gzip -f $S/ncu_16k_sol_$x.csv
done
pack
cd ..
st non_finite
MLX_ENABLE_TF32=0 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/ops/test_gated_delta.py \
  -k "non_finite" 2>&1 | tee $S/tests_h200_non_finite.txt | tail -2
pack
st done
