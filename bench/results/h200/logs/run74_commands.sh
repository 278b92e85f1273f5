# Session 22, after run 73: the LoRA step of the 4-layer model at T = 8192 (stub and
# patched) with the kept kernels (e613d40's; last measured in run 64, session 20).
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run74a.tgz.
source bench/device_run.sh 74 "$@"  # st, $S, pack, lora_8192, ...
st lora
lora_8192
pack
st done
