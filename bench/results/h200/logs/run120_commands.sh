# Run 120 (session 43): Mamba's selective-scan seam on the GPU (bench/mamba.py, Falcon-Mamba
# 7B's layer): mlx-lm's per-token loop beside the layer patched at T = 2048 and 8192 with
# the op's GPU default chunk (64), then the patched layer with chunks of 16 and 256 (the
# default is untuned on a GPU). After the set-up call, `bash <this> a <commit> 1b133f9`
# (base/ is not used); outputs in $OUT/run120a.tgz.
source bench/device_run.sh 120 "$@"  # st, $S, pack
st mamba_default
timeout 300 python3 bench/mamba.py --T 2048 8192 --repeats 3 --json $S/mamba_gpu.json \
  --md $S/mamba_gpu.md 2>&1 | grep -E "T=|rror"
pack
for c in 16 256; do
  st mamba_chunk_$c
  timeout 120 python3 bench/mamba.py --T 2048 8192 --impls chunkscan --chunk-size $c \
    --repeats 3 --json $S/mamba_gpu_c$c.json --md $S/mamba_gpu_c$c.md 2>&1 | grep -E "T=|rror"
  pack
done
st done
