# Prepared in session 18; part a ran in session 19 (run 61, the branch below as the tree:
# logs/run61_4f50e63.txt), part b did not (run 62 measured the defaults run 61 chose).
# Usage: `bash <this> <part> <commit> <base commit>`, base/ =
# `git archive <base> src` carried beside the tree.
# part a: the CUDA tests; Nsight Compute's kernel times at 16384 for the default, for
#   state_grads and output over one 128-column slice with 512 threads
#   (CHUNKSCAN_GDN_TV=128 CHUNKSCAN_GDN_NT=512: run 59 measured TV=128 at 256 threads,
#   state_grads 3312 us against 2798, input_grads 2846 against 3473), and base.
# part b: fla and chunkscan side by side at 16384 and 65536, eager and compiled (the
#   default group budget, 4 GiB on the H200), and the LoRA step at 8192.
# Part a also suits branch wip/batched-loads (16123ac: the load phases of input_grads,
# prepare and state_grads with their loads in flight together, emulated only) as the tree,
# with base/ = main: its `ncu_kernels new` against base.
# Outputs in $OUT/run61<part>.tgz.
source bench/device_run.sh 61 "$@"  # st, $BASE, $S, pack, ncu_kernels, cuda_tests, lora_8192
if [ "$1" = a ]; then
  st tests
  cuda_tests
  pack
  cd bench
  st ncu
  ncu_kernels new
  pack
  ncu_kernels new_tv128_nt512 CHUNKSCAN_GDN_TV=128 CHUNKSCAN_GDN_NT=512
  pack
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
