# Run 92 (session 29): the CUDA default group budget raised from 1/32 of the GPU's
# memory (1-4 GiB: 4096 MiB on the H200, four groups at T = 65536) to 1/8 (1-16 GiB:
# 16384 MiB, one group up to 65536), after run 91 measured one group at 65536 at 31.5 ms
# compiled / 33.0 eager against 35.7 / 37.8 with four (one sample). One call:
#   the default budget's CUDA test; the side by side at 16384 and 65536 under the new
#   default, twice (two samples, every configuration in a fresh process; the eager graph
#   build between them); the build at 16384 with the real kernels under cProfile (where the eager call's extra
#   1.4 ms over compiled goes: run 91 timed the build at 1.30-1.34 ms); T = 131072
#   compiled (two groups of the new budget), for the peak at a length past one group.
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run92a.tgz.
source bench/device_run.sh 92 "$@"  # st, $BASE, $S, pack, fla_side_by_side
st budget_test
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/ops/test_gated_delta_fused.py \
  -k default_group_budget 2>&1 | tail -1 | tee $S/tests_h200_budget.txt
cd bench
side_by_side() {
  st "side_by_side_$1"
  fla_side_by_side
  mv $S/gdn_vs_fla_h200.json $S/gdn_vs_fla_16384_65536_h200_s$1.json
  pack
}
side_by_side 1
st build_profile
timeout 90 python3 graph_build.py --T 16384 --repeats 50 --real --profile 45 > $S/graph_build_profile_h200.txt 2>&1
head -60 $S/graph_build_profile_h200.txt | cut -c1-150
tail -1 $S/graph_build_profile_h200.txt
pack
side_by_side 2
st t131072
timeout 120 python3 gdn_vs_fla.py --T 131072 --impls chunkscan --modes compiled --chunk-sizes 64 \
  --repeats 2 --json $S/gdn_131072_h200.json | grep --line-buffered -E "chunkscan|rror"
pack
st done
