# Session 22, first run: where the state pass waits, before changing it.
# `bash <this> a <commit> <commit>`.
# - The state pass's tilings on the mma.sync kernel, Nsight Compute's times of its two
#   launches in one fwd+bwd at 16384: the default (32 rows per block, a whole chunk per
#   staged piece), pieces of 32 rows (CHUNKSCAN_PASS_TC_CP=32), 64 rows per block
#   (TC_TR=64, measured before only on the wmma kernel, run 53), and 16 rows with pieces of
#   32 (86 KiB: two blocks per multiprocessor).
# - Warp-stall samples per source line (SourceCounters) of the state pass's two launches,
#   state_grads and input_grads at 16384.
# Outputs in $OUT/run71a.tgz.
source bench/device_run.sh 71 "$@"  # st, $S, pack, ...
cd bench
pass_times() {  # <tag> [VAR=value ...]: the state pass's launches only
  local tag=$1; shift
  env "$@" timeout 90 ncu --profile-from-start off --clock-control none --csv --page raw \
    --section SpeedOfLight --kernel-name regex:state_pass --log-file $S/ncu_pass_$tag.csv \
    python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
  python3 ncu_summary.py $S/ncu_pass_$tag.csv --by-name 2>&1 | sed -n 1,3p
  gzip -f $S/ncu_pass_$tag.csv
}
st sweep
for cfg in "default" "cp32 CHUNKSCAN_PASS_TC_CP=32" "tr64 CHUNKSCAN_PASS_TC_TR=64" \
    "tr16cp32 CHUNKSCAN_PASS_TC_TR=16 CHUNKSCAN_PASS_TC_CP=32"; do
  set -- $cfg
  echo "--- $1"
  pass_times "$@"
done
pack
st source
CHUNKSCAN_CUDA_LINEINFO=1 CHUNKSCAN_CUDA_CACHE=/tmp/c_li timeout 200 ncu --profile-from-start off \
  --clock-control none --section SourceCounters --import-source yes \
  --kernel-name regex:"state_pass_mma|gdn_state_grads|gdn_input_grads" --launch-count 4 \
  -o $S/ncu_src python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
ncu -i $S/ncu_src.ncu-rep --page source --csv --print-source cuda,sass > $S/ncu_src_cuda_sass.csv 2>&1
gzip -f $S/ncu_src_cuda_sass.csv; rm -f $S/ncu_src.ncu-rep
pack
st done
