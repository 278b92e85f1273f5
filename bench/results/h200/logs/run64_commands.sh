# Session 20: the tensor-core products' operand reads (tc_run: one pointer per fragment
# and constant offsets, the k steps unrolled; operands exact in tf32 or written rounded
# once, CS_OPERAND, read without rounding) and state_grads' pieces of 64 columns of Dk
# in a wide block. `bash <this> <part> <commit> <base commit>`.
# part a: the CUDA tests; Nsight Compute's kernel times at 16384, new and base/.
# part b: fla and chunkscan side by side at 16384 and 65536, eager and compiled; the LoRA
#   step at 8192 (stub and patched).
# Outputs in $OUT/run64<part>.tgz.
source bench/device_run.sh 64 "$@"  # st, $BASE, $S, pack, ncu_kernels, cuda_tests, lora_8192
if [ "$1" = a ]; then
  st tests
  cuda_tests
  pack
  cd bench
  st ncu
  ncu_kernels new
  pack
  st ncu_base
  ncu_base
  pack
else
  cd bench
  st fla
  timeout 300 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_h200.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
  pack
  cd ..
  st lora
  lora_8192
  pack
fi
st done
