# Run 112 (session 40): issue 9's first compiled LoRA step at T = 2048 (acceptance: at
# most 10 s; last measured in session 5), on a fresh machine and then with the caches it
# filled, and one more side-by-side sample at 16384 (run 111's eager figure came from
# three repeats). After the set-up call, `bash <this> a <commit> 5085d42` (base/ is not
# used); outputs in $OUT/run112a.tgz:
#   a: the 4-layer LoRA step at T = 2048, stub then patched, twice (the first from the
#      fresh machine's empty kernel caches, MLX's PTX cache and chunkscan's; the second
#      with what the first compiled), then one side-by-side sample at 16384, ten repeats
#      (samples_16384 1).
source bench/device_run.sh 112 "$@"  # st, $S, pack, samples_16384
CFG=$(cat bench/lora_4layer.json)
for pass in fresh warm; do
  st "lora_2048_$pass"
  timeout 200 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 180 \
    --T 2048 --modes stub patched --json $S/lora_h200_2048_$pass.json 2>&1 | tail -3
  pack
done
cd bench
samples_16384 1
st done
