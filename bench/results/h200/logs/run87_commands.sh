# Run 87 (session 25), the session's last device time: main as the session leaves it
# (<commit>: run 86's code and the default device's index once per call) against base/ =
# 2b24b2a (session 24's end). `bash <this> a <commit> <base commit>`. Stages: the graph
# build with the real kernels, new and base; fla side by side (16384 and 65536, eager and
# compiled) twice, each packed as it ends. Outputs in $OUT/run87a.tgz.
source bench/device_run.sh 87 "$@"  # st, $BASE, $S, pack, fla_side_by_side
cd bench
st graph_build
timeout 60 python3 graph_build.py --T 16384 --repeats 50 --real 2>&1 | tail -1
timeout 60 $BASE python3 graph_build.py --T 16384 --repeats 50 --real 2>&1 | tail -1
timeout 30 python3 graph_build.py --T 16384 --repeats 50 --real 2>&1 | tail -1
pack
for i in 1 2; do
  st fla$i
  fla_side_by_side
  mv $S/gdn_vs_fla_h200.json $S/gdn_vs_fla_h200_$i.json
  pack
done
st done
