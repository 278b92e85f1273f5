# Session 20, after run 64: the copied tiles that are only tensor-core operands (output's
# w, p, u and S; state_grads' p, w and kt; input_grads' d_w) rounded to tf32 once as they
# land (copy_tile<.., true>, operand_landed) and read without rounding.
# `bash <this> <part> <commit> <base commit>` (base: run 64's code).
# part a: the CUDA tests; Nsight Compute's kernel times at 16384, new and base/.
# part b: fla and chunkscan side by side at 16384 and 65536, eager and compiled; the LoRA
#   step at 8192 (stub and patched).
# Outputs in $OUT/run65<part>.tgz.
source bench/device_run.sh 65 "$@"  # st, $S, pack, cuda_tests, ncu_kernels, ncu_base, ...
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
  fla_side_by_side
  pack
  cd ..
  st lora
  lora_8192
  pack
fi
st done
