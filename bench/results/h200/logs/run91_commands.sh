# Run 91 (session 26). A second sample of run 90's side by side under the cotangents
# harness (run 90: 1.94x / 2.17x compiled, 2.18x / 2.38x eager at 16384 / 65536), and
# where eager's graph build goes on the device's CPU at 65536 (four groups) and 16384
# (bench/graph_build.py --real --profile 25: cProfile's costliest functions, own time).
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run91a.tgz.
source bench/device_run.sh 91 "$@"  # st, $S, pack
cd bench
st fla
timeout 300 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --harness cotangents --json $S/gdn_vs_fla_h200.json \
  | grep --line-buffered -E "fla|chunkscan|rror"
pack
st graph_build
for T in 65536 16384; do
  timeout 60 python3 graph_build.py --T $T --repeats 30 --real --profile 25 2>&1 | grep -v -i warn \
    | tee $S/graph_build_profile_$T.txt | tail -32
done
pack
st done
