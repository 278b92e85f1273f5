# Run 103 (session 36): a side-by-side sample at T = 16384 on an H200, if one can be
# started (the runs before it this session came on an H100): fla and chunkscan, eager and
# compiled, C = 64, ten repeats (bench/device_run.sh's samples_16384).
# After the set-up call: `bash <this> a <commit> c652525` (the commit written out, not
# $(git rev-parse ...): the device's copy of the tree has stale git metadata);
# outputs in $OUT/run103a.tgz.
source bench/device_run.sh 103 "$@"
cd bench
samples_16384 1
st done
