# Prepared in session 15 for the next machine (not run yet): `bash <this> <part> <commit> <base commit>`,
# base/ = `git archive <base> src` carried beside the tree.
# part a (main, base/ = e590d34: before prepare's products took the tensor cores): the op's
#   timer at 16384 new and base alternating twice (run 51 measured prepare under Nsight
#   Compute only); then fla and chunkscan side by side at 16384 and 65536.
# part b: the LoRA step at 8192 (run 50's 1.62x was before prepare's change).
# part c (working tree = branch wip/output-pieces, base/ = main): Nsight Compute new and
#   base (output with q, w, S in pieces: 63.5 KiB, but 128 registers in NVRTC for bf16 with
#   TF32, so two blocks per multiprocessor as before unless the registers come down), and
#   the CUDA tests of both fused-kernel files.
# Outputs in $OUT/run52<part>.tgz.
source bench/device_run.sh 52 "$@"  # st, $BASE, $S, pack, ncu_kernels
if [ "$1" = a ]; then
  cd bench
  st op16k
  for i in 1 2; do
    timeout 60 python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes compiled eager \
      --chunk-sizes 64 --repeats 5 --json $S/gdn_16k_new_$i.json | grep -E "chunkscan|rror" | sed 's/^/new /'
    timeout 60 $BASE python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes compiled eager \
      --chunk-sizes 64 --repeats 5 --json $S/gdn_16k_base_$i.json | grep -E "chunkscan|rror" | sed 's/^/base/'
  done
  pack
  st fla
  timeout 330 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_h200.json | grep -E "fla|chunkscan|rror"
  pack
elif [ "$1" = b ]; then
  st lora
  CFG='{"hidden_size": 2048, "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024}'
  timeout 280 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$CFG" --timeout 250 \
    --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -3
  pack
else
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
    | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error|\{'o'" | tail -12
  pack
fi
st done
