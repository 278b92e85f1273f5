# Run 102 (session 36), on the machine run 101 left warm (an H100: no H200 could be
# started): where the eager build's time goes on the device, and the LoRA step at
# T = 8192, which no code since session 24 (bc385b6, run 82) had run.
#   graph_build --real --profile 30: the fused path's graph build at T = 16384 with the
#   real kernels (100 builds; cProfile's costliest functions over them);
#   lora_8192: the 4-layer model's LoRA step, stub and patched (--repeats 3).
# One call after run 101's set-up: `bash <this> a <commit> c652525`; outputs in
# $OUT/run102a.tgz.
source bench/device_run.sh 102 "$@"
st graph_build
(cd bench && timeout 150 python3 graph_build.py --T 16384 --repeats 100 --group-mib 16384 \
  --real --profile 30 --json $S/graph_build_real.json > $S/graph_build_real.txt 2>&1;
  tail -45 $S/graph_build_real.txt)
pack
st lora
lora_8192
pack
st done
