# Session 15: `bash <this> <part> <commit> <base commit>`, base/ = `git archive <base> src`
# carried beside the tree (base: main before state_grads took S and dS in pieces).
# part a: Nsight Compute's kernel times at 16384, new then base; the CUDA tests of both
#   fused-kernel files; then the new code with every kernel at 512 threads
#   (CHUNKSCAN_GDN_NT=512: state_grads 105 KiB, two blocks of 16 warps per multiprocessor)
#   and with 32 columns per state_grads / output block (CHUNKSCAN_GDN_TV=32: 63 KiB, three).
# part b: fla and chunkscan side by side at 16384 and 65536 (eager and compiled), then
#   base's op at 16384.
# part c: the LoRA step at 8192, stub and patched.
# Outputs in $OUT/run50<part>.tgz.
source bench/device_run.sh 50 "$@"  # st, $BASE, $S, pack, ncu_kernels
if [ "$1" = a ]; then
  cd bench
  st ncu
  ncu_kernels new
  BASE_ENV=${BASE#env }
  ncu_kernels base $BASE_ENV
  pack
  cd ..
  st tests
  MLX_ENABLE_TF32=0 timeout 240 python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
    | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -8
  pack
  cd bench
  st variants
  ncu_kernels nt512 CHUNKSCAN_GDN_NT=512
  ncu_kernels tv32 CHUNKSCAN_GDN_TV=32
  pack
elif [ "$1" = b ]; then
  cd bench
  st fla
  timeout 330 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_h200.json | grep -E "fla|chunkscan|rror"
  pack
  st base16k
  timeout 60 $BASE python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes eager compiled \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_16k_base_h200.json | grep -E "chunkscan|rror"
  pack
else
  st lora
  CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
  timeout 280 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 250 \
    --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -3
  pack
fi
st done
