# device call 2 of session 13's first machine (committed as
# bench/results/h200/logs/run46_commands.sh): `bash <this> <commit> <base>`, base/ =
# `git archive <base> src` carried beside it (main), the working tree at branch
# wip/input-grads-tf32 (input_grads' d_a a^T, d_l, dq, dk, dv as TF32 products).
# 1. the CUDA tests of both fused-kernel files (MLX's TF32 off, the TF32 tests forcing
#    ours on); 2. the op at 16384, new then base, twice; 3. the group budget at 16384
#    and 65536 (base); 4. Nsight Compute's source counters of prepare, input_grads and
#    state_grads at 4096 with line information (CHUNKSCAN_CUDA_LINEINFO=1).
# Outputs in $OUT/run46.tgz.
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
export CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$2 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
test -d base/src/chunkscan || echo "NO BASE"
S=/tmp/so46; mkdir -p $S
pack() { tar czf $OUT/run46.tgz -C $S . ; }
st tests
MLX_ENABLE_TF32=0 timeout 240 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -8
pack
cd bench
st op16k
G="python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 --modes compiled eager"
for i in 1 2; do
  timeout 45 $G --json $S/gdn_16k_new_$i.json | grep -E "chunkscan|rror"
  timeout 45 $BASE $G --json $S/gdn_16k_base_$i.json | grep -E "chunkscan|rror"
done
pack
st groups
timeout 110 $BASE python3 gdn_vs_fla.py --T 16384 --repeats 3 --impls chunkscan --chunk-sizes 64 \
  --modes compiled --group-mib 128 256 512 1024 2048 --json $S/groups_16k.json | grep -E "chunkscan|rror"
timeout 90 $BASE python3 gdn_vs_fla.py --T 65536 --repeats 3 --impls chunkscan --chunk-sizes 64 \
  --modes compiled --group-mib 256 1024 --json $S/groups_64k.json | grep -E "chunkscan|rror"
pack
st ncu_source
CHUNKSCAN_CUDA_LINEINFO=1 CHUNKSCAN_CUDA_CACHE=/tmp/c_li timeout 150 ncu --profile-from-start off \
  --clock-control none --section SourceCounters --import-source yes \
  --kernel-name regex:"chunkscan_gdn_(prepare|input_grads|state_grads)" --launch-count 3 \
  -o $S/ncu_src python3 ncu_op.py --impl chunkscan --T 4096 2>&1 | tail -2
for p in cuda sass; do
  ncu -i $S/ncu_src.ncu-rep --page source --csv --print-source $p > $S/ncu_src_$p.csv 2>&1
done
ls -la $S /tmp/c_li/src 2>&1 | tail -12; gzip -f $S/ncu_src_*.csv; rm -f $S/ncu_src.ncu-rep
pack
st done
