# Run 115 (session 41): chunkscan.linear_attention's chunk size on the GPU (its default,
# 64, is the CPU's best: 2.59 s at T = 2048 against 3.52 with 128 and 5.05 with 256; run
# 114 measured 0.237 s at T = 8192 with 64, launch-bound), then one issue-9 side-by-side
# sample at T = 16384, ten repeats. After the set-up call, `bash <this> a <commit>
# 1b133f9` (base/ is not used); outputs in $OUT/run115a.tgz.
source bench/device_run.sh 115 "$@"  # st, $S, pack, samples_16384
cd bench
for C in 64 128 256; do
  st "linear_attention_C$C"
  timeout 100 python3 linear_attention.py --T 8192 32768 --impls chunkscan --chunk-size $C \
    --repeats 3 --json $S/linear_attention_gpu_C$C.json --md $S/linear_attention_gpu_C$C.md \
    2>&1 | grep "chunkscan T"
  pack
done
samples_16384 1
st done
