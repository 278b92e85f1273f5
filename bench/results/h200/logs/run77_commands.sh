# Session 23, last run: the kernels of run 76 (main at <commit>; the kernels of 902e875)
# measured again on a fresh machine: fla side by side at 16384 and 65536 (run 76's fla
# took 5.67 ms at 16384, 0.4-0.6 ms more than in runs 64-73), the portable path (kernels
# off) at 16384, C = 128, compiled and eager (last measured in run 23), the LoRA step at
# 8192. `bash <this> a <commit> <commit>`. Outputs in $OUT/run77a.tgz.
source bench/device_run.sh 77 "$@"  # st, $S, pack, fla_side_by_side, lora_8192
cd bench
st fla
fla_side_by_side
pack
st portable
timeout 150 python3 gdn_vs_fla.py --T 16384 --impls chunkscan-portable --modes compiled eager \
  --chunk-sizes 128 --repeats 3 --json $S/gdn_portable_16384_h200.json \
  | grep --line-buffered -E "chunkscan|rror"
pack
cd ..
st lora
lora_8192
pack
st done
