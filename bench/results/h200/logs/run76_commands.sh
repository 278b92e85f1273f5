# Session 23, second run: run 75's helpers with chunk_gates by warp scans, fill_gam's
# first span read four gates at a time, output in steps of 64 columns of Dv (256 threads,
# 101 KiB: two blocks a multiprocessor), the tensor-core products' k-contiguous operands
# by ldmatrix (tc_run; the state pass's phase 1), against main (base/, 6f35f7c).
# `bash <this> a <commit> 6f35f7c`: the CUDA tests, Nsight Compute's kernel times at 16384
#   new and base, the phase clocks, then output in one step of 128 columns with 512
#   threads (CHUNKSCAN_GDN_OUT_TH=128, the kernel before its steps) and every kernel at
#   512 threads (output: two blocks of 512 a multiprocessor). Outputs in $OUT/run76a.tgz.
# `bash <this> b <commit> 6f35f7c`: fla side by side at 16384 and 65536, the LoRA step at
#   8192. Outputs in $OUT/run76b.tgz.
source bench/device_run.sh 76 "$@"  # st, $BASE, $S, pack, kernel_checks, ...
if [ "$1" = a ]; then
  kernel_checks
  cd bench
  st ncu_th128
  ncu_kernels th128 CHUNKSCAN_GDN_OUT_TH=128
  pack
  st ncu_nt512
  ncu_kernels nt512 CHUNKSCAN_GDN_NT=512
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
