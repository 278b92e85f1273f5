# Session 17: `bash <this> <part> <commit> <base commit>`, base/ = `git archive <base> src`
# carried beside the tree (8da8adb: main before input_grads' products went to csg::Prod).
# part a: the CUDA tests of both fused-kernel files, Nsight Compute's kernel times at 16384
#   new and base, the phase clocks of both (C = 64).
# part b: fla and chunkscan side by side at 16384 and 65536, eager and compiled.
# part c: the LoRA step at 8192 (1.62x the stub in run 50, before sessions 15-17).
# Outputs in $OUT/run56<part>.tgz.
source bench/device_run.sh 56 "$@"  # st, $BASE, $S, pack, ncu_kernels, cuda_tests, lora_8192
if [ "$1" = a ]; then
  st tests
  cuda_tests
  pack
  cd bench
  st ncu
  ncu_kernels new
  pack
  BASE_ENV=${BASE#env }
  ncu_kernels base $BASE_ENV
  pack
  st profile
  timeout 40 python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64_new.json 2>&1 | tail -1
  timeout 40 $BASE python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64_base.json 2>&1 | tail -1
  pack
elif [ "$1" = b ]; then
  cd bench
  st fla
  timeout 420 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_h200.json | grep --line-buffered -E "fla|chunkscan|rror"
  pack
else
  st lora
  lora_8192
  pack
fi
st done
