# Session 24, run 81: fla side by side again at the kernels of run 80 (a second machine's
# sample: run 80's eager row at 16384, 12.34 ms, sat 1 ms above runs 76-77's).
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run81a.tgz.
source bench/device_run.sh 81 "$@"  # st, $S, pack, fla_side_by_side
cd bench
st fla
fla_side_by_side
pack
st done
