# Session 18, second machine: `bash <this> <commit>`. The default group budget is now 4 GiB
# on the H200 (1 GiB before): the LoRA step at 8192, patched, with the new default and with
# CHUNKSCAN_GDN_GROUP_MIB=1024 (the old default) in the same call (no stub: 337 s of device
# time were left); the default budget's test on the device. Outputs in $OUT/run60a.tgz.
source bench/device_run.sh 60 a "$@" none  # st, $S, pack, lora_8192
st test
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/ops/test_gated_delta_fused.py \
  -k default_group_budget 2>&1 | tail -1
st lora
cfg=$(cat bench/lora_4layer.json)
for mib in default 1024; do
  env $([ $mib = 1024 ] && echo CHUNKSCAN_GDN_GROUP_MIB=1024) timeout 200 python3 bench/lora.py \
    --dtype bfloat16 --repeats 3 --config "$cfg" --timeout 180 --T 8192 --modes patched \
    --json $S/lora_h200_8192_group$mib.json 2>&1 | tail -1
  pack
done
st done
