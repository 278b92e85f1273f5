# Session 18: `bash <this> <part> <commit> <base commit>`, base/ = `git archive <base> src`
# carried beside the tree (d8eda36: main before the two small kernels of _rows_cuda).
# part a: the CUDA tests of the kernel test files, Nsight Compute's kernel times at 16384
#   new, base, and new with CHUNKSCAN_GDN_TV=128 (output and state_grads one Dv slice).
# part b: fla and chunkscan side by side at 16384 and 65536, eager and compiled, chunkscan
#   also with a 4 GiB group budget (--group-mib 4096: fewer groups, fewer launches).
# part c: the LoRA step at 8192 (and patched with CHUNKSCAN_GDN_GROUP_MIB=4096); chunkscan
#   at 16384, eager and compiled, base and new in the same call.
# Outputs in $OUT/run59<part>.tgz.
source bench/device_run.sh 59 "$@"  # st, $BASE, $S, pack, ncu_kernels, cuda_tests, lora_8192
F="Traceback|File|sys.exit|print|\^|BrokenPipe"
if [ "$1" = a ]; then
  st tests
  cuda_tests
  pack
  cd bench
  st ncu
  ncu_kernels new 2>&1 | grep -v -E "$F"
  pack
  BASE_ENV=${BASE#env }
  ncu_kernels base $BASE_ENV 2>&1 | grep -v -E "$F"
  pack
  ncu_kernels new_tv128 CHUNKSCAN_GDN_TV=128 2>&1 | grep -v -E "$F"
  pack
elif [ "$1" = b ]; then
  cd bench
  st fla
  timeout 540 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
    --chunk-sizes 64 --group-mib 0 4096 --repeats 3 --json $S/gdn_vs_fla_h200.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
  pack
else
  st lora
  lora_8192
  pack
  cfg=$(cat bench/lora_4layer.json)
  CHUNKSCAN_GDN_GROUP_MIB=4096 timeout 200 python3 bench/lora.py --dtype bfloat16 --repeats 3 \
    --config "$cfg" --timeout 180 --T 8192 --modes patched \
    --json $S/lora_h200_8192_group4096.json 2>&1 | tail -2
  pack
  st base_new
  cp -r bench base/  # base/bench/gdn_vs_fla.py measures base/src (its children's path)
  for which in base new; do
    root=$([ $which = base ] && echo base || echo .)
    timeout 150 python3 $root/bench/gdn_vs_fla.py --T 16384 --impls chunkscan \
      --modes eager compiled --chunk-sizes 64 --repeats 3 --json $S/gdn_16k_$which.json \
      | grep --line-buffered -E "chunkscan|rror"
    pack
  done
fi
st done
