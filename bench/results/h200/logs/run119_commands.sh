# Run 119 (session 43): the CUDA tests after session 42's changes, then, on an H200 (none
# since run 105), issue 9's figures. After the set-up call,
# `bash <this> <part> <commit> 1b133f9` (base/ is not used); outputs in $OUT/run119<part>.tgz:
#   a: the CUDA tests of the rows kernel (its branch in _non_finite_reach now also requires
#      beta, a97bce2) and of the state passes (cuda_tests), then linear_attention's tests
#      on the GPU (the final read's changes of session 42 came after run 118's part d);
#   b: fla and chunkscan side by side at T = 16384 and 65536, eager and compiled, C = 64
#      (fla_side_by_side), then the portable path (kernels off) at 16384, C = 128;
#   c: the LoRA step of the 4-layer model at T = 8192, stub and patched (lora_8192), then
#      the first compiled step at T = 2048 on this machine (stub first, then patched);
#   d: session 43's Mamba2 seam on the GPU: its tests (tests/test_mlx_lm.py -k "mamba2 or
#      ssd"), then bench/mamba2.py (mlx-lm's ssm_attn beside it patched, Nemotron-H 8B's
#      layer) at T = 2048 and 8192.
source bench/device_run.sh 119 "$@"  # st, $S, pack, cuda_tests, fla_side_by_side, lora_8192
case "$RUN_PART" in
a)
  st tests
  cuda_tests tests/ops/test_gated_delta_rows.py tests/ops/test_gated_delta_passes.py
  pack
  st linear_attention_tests
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_linear_attention.py \
    -k "not memory" 2>&1 | tee $S/tests_gpu_linear_attention.txt | tail -2
  pack
  ;;
b)
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
c)
  st lora
  lora_8192
  pack
  st lora_2048_first_step
  timeout 200 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$(cat bench/lora_4layer.json)" \
    --timeout 180 --T 2048 --modes stub patched --json $S/lora_h200_2048.json 2>&1 | tail -3
  pack
  ;;
d)
  st mamba2_tests
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mlx_lm.py -k "mamba2 or ssd" \
    2>&1 | tee $S/tests_gpu_mamba2.txt | tail -2
  pack
  st mamba2_bench
  timeout 400 python3 bench/mamba2.py --T 2048 8192 --repeats 3 --json $S/mamba2_gpu.json \
    --md $S/mamba2_gpu.md 2>&1 | grep -E "T=|rror"
  pack
  ;;
esac
st done
