# Run 118 (session 42): the CUDA tests on the last code (supports(strict=...) and the
# tiling-knob errors of session 41 came after run 114's tests), then issue 9's figures.
# After the set-up call, `bash <this> <part> <commit> 1b133f9` (base/ is not used);
# outputs in $OUT/run118<part>.tgz:
#   a: the CUDA tests of the fused chunk kernels, the state passes and the rows kernel
#      (cuda_tests);
#   b: fla and chunkscan side by side at T = 16384 and 65536, eager and compiled, C = 64
#      (fla_side_by_side), then the portable path (kernels off) at 16384, C = 128;
#   c: the LoRA step of the 4-layer model at T = 8192, stub and patched (lora_8192);
#   d: session 42's chunk-parallel linear_attention: its tests on the GPU, then beside
#      bailing_hybrid's chunked recurrent_gla at T = 8192 and 32768: C = 64, 128, 256
#      under the default group budget, and C = 64 / 256 with 1024 and 256 MiB groups
#      (CHUNKSCAN_LA_GROUP_MIB; bench/linear_attention.py).
source bench/device_run.sh 118 "$@"  # st, $S, pack, cuda_tests, fla_side_by_side, lora_8192
case "$RUN_PART" in
a)
  st tests
  cuda_tests
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
  ;;
d)
  st linear_attention_tests
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_linear_attention.py \
    -k "not memory" 2>&1 | tee $S/tests_gpu_linear_attention.txt | tail -2
  pack
  cd bench
  la() {  # <tag> <chunk size> [VAR=value]: chunkscan at 8192 and 32768
    st linear_attention_$1
    env $3 timeout 100 python3 linear_attention.py --T 8192 32768 --impls chunkscan --repeats 3 \
      --chunk-size $2 --json $S/linear_attention_gpu_$1.json --md $S/linear_attention_gpu_$1.md \
      2>&1 | grep -E "T=|rror"
    pack
  }
  la C64 64; la C128 128; la C256 256
  la C64_g1024 64 CHUNKSCAN_LA_GROUP_MIB=1024; la C256_g1024 256 CHUNKSCAN_LA_GROUP_MIB=1024
  la C64_g256 64 CHUNKSCAN_LA_GROUP_MIB=256
  st mlx_lm_chunked
  timeout 100 python3 linear_attention.py --T 8192 32768 --impls mlx_lm_chunked --repeats 3 \
    --json $S/linear_attention_gpu_hybrid.json --md $S/linear_attention_gpu_hybrid.md \
    2>&1 | grep -E "T=|rror"
  pack
  ;;
esac
st done
