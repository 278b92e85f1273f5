# Run 114 (session 41): issue 9's acceptance on an H200, if one comes (none since run
# 105; the op's kernels unchanged since run 110's a431d37). After the set-up call,
# `bash <this> <part> <commit> 1b133f9` (base/ is not used); outputs in $OUT/run114<part>.tgz:
#   a: fla and chunkscan side by side at T = 16384 and 65536, eager and compiled, C = 64
#      (fla_side_by_side), then the portable path (kernels off) at 16384, C = 128;
#   b: the 4-layer LoRA step at T = 2048 on the machine's caches as part a left them
#      (MLX's PTX cache holds fla's and the op's kernels, not the model's), then at 8192
#      (lora_8192);
#   c: the CUDA tests of the fused kernels, the state passes and the rows (cuda_tests).
source bench/device_run.sh 114 "$@"  # st, $S, pack, fla_side_by_side, lora_8192, cuda_tests
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
  st lora_2048
  timeout 200 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$(cat bench/lora_4layer.json)" \
    --timeout 180 --T 2048 --modes stub patched --json $S/lora_h200_2048.json 2>&1 | tail -3
  pack
  st lora_8192
  lora_8192
  pack
  ;;
c)
  st tests
  cuda_tests
  pack
  ;;
esac
st done
