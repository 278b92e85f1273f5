# Run 122 (session 44): the new ops' GPU checks, or on an H200 issue 9's figures. After
# the set-up call, `bash <this> <part> <commit> 1b133f9`; outputs in $OUT/run122<part>.tgz:
#   a: the RWKV-7 and RG-LRU seams' tests on the GPU (run 121 cut the RWKV-7 ones by
#      their limit while the fresh machine compiled), diagonal_recurrence's op tests but
#      the memory one, then bench/rg_lru.py (RecurrentGemma 2B's recurrent block, bf16)
#      at T = 1024 and 4096 with the default chunk (64) and with 16.
# For issue 9 on an H200 the same call runs run 119's parts b (fla side by side, the
# portable path) and c (the LoRA step), unchanged since session 41: `bash
# bench/results/h200/logs/run119_commands.sh b <commit> 1b133f9`.
source bench/device_run.sh 122 "$@"  # st, $S, pack
case "$RUN_PART" in
a)
  st seam_tests
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_mlx_lm.py -k "rwkv7 or rg_lru" \
    2>&1 | tee $S/tests_gpu_rwkv7_rg_lru_seams.txt | tail -2
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/ops/test_diagonal.py -k "not memory" \
    2>&1 | tee $S/tests_gpu_diagonal.txt | tail -2
  pack
  st rg_lru_bench
  timeout 150 python3 bench/rg_lru.py --T 1024 4096 --repeats 3 --json $S/rg_lru_gpu.json \
    --md $S/rg_lru_gpu.md 2>&1 | grep -E "T=|rror"
  pack
  timeout 60 python3 bench/rg_lru.py --T 4096 --impls chunkscan --chunk-size 16 --repeats 3 \
    --json $S/rg_lru_gpu_c16.json --md '' 2>&1 | grep -E "T=|rror"
  pack
  ;;
esac
st done
