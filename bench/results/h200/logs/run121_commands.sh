# Run 121 (session 44): chunkscan.dplr_delta_rule (RWKV-7) on a GPU, the portable path
# (no kernel). After the set-up call, `bash <this> <part> <commit> 1b133f9`; outputs in
# $OUT/run121<part>.tgz:
#   a: its op tests but the memory one (tests/ops/test_dplr_delta.py) and the RWKV-7 seam's
#      (tests/test_mlx_lm.py -k rwkv7) on the GPU, then bench/rwkv7.py (mlx-lm's
#      Rwkv7TimeMixing beside it patched, RWKV-7 1.5B's layer, bfloat16) at T = 1024 and
#      4096 (mlx-lm's loop keeps several MiB per token), then chunkscan alone at 16384.
source bench/device_run.sh 121 "$@"  # st, $S, pack
case "$RUN_PART" in
a)
  st tests
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_dplr_delta.py \
    -k "not memory" 2>&1 | tee $S/tests_gpu_dplr.txt | tail -2
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mlx_lm.py -k rwkv7 \
    2>&1 | tee $S/tests_gpu_rwkv7_seam.txt | tail -2
  pack
  st rwkv7_bench
  timeout 240 python3 bench/rwkv7.py --T 1024 4096 --repeats 3 --json $S/rwkv7_gpu.json \
    --md $S/rwkv7_gpu.md 2>&1 | grep -E "T=|rror"
  pack
  st rwkv7_16384
  timeout 100 python3 bench/rwkv7.py --T 16384 --impls chunkscan --repeats 3 \
    --json $S/rwkv7_gpu_16384.json --md $S/rwkv7_gpu_16384.md 2>&1 | grep -E "T=|rror"
  pack
  ;;
esac
st done
