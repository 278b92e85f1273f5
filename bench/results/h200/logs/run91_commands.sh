# Run 91 (session 26). A second sample of run 90's side by side under the cotangents
# harness (run 90: 1.94x / 2.17x compiled, 2.18x / 2.38x eager at 16384 / 65536), and at
# 65536 the group budget: the default 4096 MiB (four groups: three `prepare` launches
# run again in the backward, 2.43 ms, and 24 joining copies, 0.97 ms, run 89) against
# 8192 (two groups) and 16384 (one), for what a larger budget would buy and cost.
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run91a.tgz.
source bench/device_run.sh 91 "$@"  # st, $S, pack
cd bench
st fla65
timeout 300 python3 gdn_vs_fla.py --T 65536 --impls fla chunkscan --modes compiled eager \
  --chunk-sizes 64 --repeats 3 --group-mib 0 8192 16384 --json $S/gdn_vs_fla_65536_groups_h200.json \
  | grep --line-buffered -E "fla|chunkscan|rror"
pack
st fla16
timeout 150 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan --modes compiled eager \
  --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_16384_h200.json \
  | grep --line-buffered -E "fla|chunkscan|rror"
pack
st done
