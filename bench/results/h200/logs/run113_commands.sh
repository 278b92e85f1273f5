# Run 113 (session 40): a first call's kernels built together (34866fe:
# _precompile.compile_first) against one at a time (base 1b133f9: the op's sources before
# it; base/ holds `git archive 1b133f9 src`). After the set-up call, `bash <this> a
# <commit> 1b133f9`; outputs in $OUT/run113a.tgz:
#   a: the op's first call at T = 4096 (eager, C = 64) from an empty chunkscan kernel
#      cache: new (which also fills MLX's own caches), then base, new, base, each with a
#      cache folder of its own; the 4-layer LoRA step at T = 2048, stub then patched (new),
#      then patched alone with an empty chunkscan cache, base then new (MLX's caches warm
#      by then); then the CUDA tests of the precompiled kernels and of the fused op.
source bench/device_run.sh 113 "$@"  # st, $S, $BASE, pack, cuda_tests
cd bench
st first_calls
for who in new base new base; do
  n=$((${n:-0} + 1))
  if [ $who = new ]; then pre=env; else pre=$BASE; fi
  $pre CHUNKSCAN_CUDA_CACHE=/tmp/c_first$n timeout 100 python3 gdn_vs_fla.py --T 4096 \
    --impls chunkscan --modes eager --chunk-sizes 64 --repeats 1 \
    --json $S/gdn_first_call_${n}_$who.json | grep -E "chunkscan|rror" | sed "s/^/$who: /"
done
pack
cd ..
CFG=$(cat bench/lora_4layer.json)
st lora_2048
CHUNKSCAN_CUDA_CACHE=/tmp/c_lora1 timeout 200 python3 bench/lora.py --dtype bfloat16 --repeats 3 \
  --config "$CFG" --timeout 180 --T 2048 --modes stub patched \
  --json $S/lora_h200_2048_fresh.json 2>&1 | tail -1
pack
for who in base new; do
  if [ $who = new ]; then pre=env; else pre=$BASE; fi
  $pre CHUNKSCAN_CUDA_CACHE=/tmp/c_lora_$who timeout 120 python3 bench/lora.py --dtype bfloat16 \
    --repeats 3 --config "$CFG" --timeout 100 --T 2048 --modes patched \
    --json $S/lora_h200_2048_cold_chunkscan_$who.json 2>&1 | tail -1 | sed "s/^/$who: /"
  pack
done
st tests
cuda_tests tests/test_precompile.py tests/ops/test_gated_delta_fused.py
pack
st done
