# Session 18, second machine: `bash <this> <commit>`. The default group budget is now 4 GiB
# on the H200 (1 GiB before): the LoRA step at 8192, stub, patched with the new default and
# patched with CHUNKSCAN_GDN_GROUP_MIB=1024 (the old default) in the same call; the default
# budget's test on the device. Outputs in $OUT/run60a.tgz.
source bench/device_run.sh 60 a "$@" none  # st, $S, pack, lora_8192
st test
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/ops/test_gated_delta_fused.py \
  -k default_group_budget 2>&1 | tail -1
st lora
lora_8192
pack
cfg=$(cat bench/lora_4layer.json)
CHUNKSCAN_GDN_GROUP_MIB=1024 timeout 200 python3 bench/lora.py --dtype bfloat16 --repeats 3 \
  --config "$cfg" --timeout 180 --T 8192 --modes patched \
  --json $S/lora_h200_8192_group1024.json 2>&1 | tail -1
pack
st done
