# Run 111 (session 40): issue 9's figures on the current code (the op's sources as at
# 1b133f9; session 39's runs came on an H100 only). After the set-up call, `bash <this>
# <part> <commit> 5085d42` (base/ is not used); outputs in $OUT/run111<part>.tgz:
#   a: fla and chunkscan side by side at T = 16384 and 65536, eager and compiled, C = 64
#      (fla_side_by_side), then the portable path (kernels off) at 16384, C = 128;
#   b: the LoRA step of the 4-layer model at T = 8192, stub and patched (lora_8192);
#   c: the memory / time trade-off under the process's settings with the current
#      kernels (64 MB command graphs, MLX's memory limit above the inputs,
#      save_states="groups"; last measured with session 14's kernels, runs 48-49), beside
#      fla at 16384.
source bench/device_run.sh 111 "$@"  # st, $S, pack, fla_side_by_side, lora_8192
case "$RUN_PART" in
a)
  cd bench
  st side_by_side
  fla_side_by_side
  pack
  st portable
  timeout 200 python3 gdn_vs_fla.py --T 16384 --impls chunkscan-portable --modes compiled eager \
    --chunk-sizes 128 --repeats 3 --json $S/gdn_portable_16384_h200.json \
    | grep --line-buffered -E "chunkscan|rror"
  pack
  ;;
b)
  st lora
  lora_8192
  pack
  ;;
c)
  cd bench
  st tradeoff_16384
  MLX_MAX_MB_PER_BUFFER=64 timeout 330 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan \
    --modes compiled eager --chunk-sizes 64 --save groups --group-mib 256 1024 \
    --memory-limit-mib 256 512 1024 2048 --repeats 3 --budget 320 \
    --json $S/gdn_tradeoff_16384_h200.json | grep --line-buffered -E "fla|chunkscan|rror"
  pack
  st tradeoff_65536
  MLX_MAX_MB_PER_BUFFER=64 timeout 200 python3 gdn_vs_fla.py --T 65536 --impls chunkscan \
    --modes compiled eager --chunk-sizes 64 --save groups --group-mib 256 \
    --memory-limit-mib 256 1024 --repeats 3 --budget 190 \
    --json $S/gdn_tradeoff_65536_h200.json | grep --line-buffered -E "chunkscan|rror"
  pack
  ;;
esac
st done
