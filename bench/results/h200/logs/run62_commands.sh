# Session 19, the defaults run 61 chose (cc6bce0: at C = 64 output and state_grads over
# all 128 columns of Dv with 512 threads). `bash <this> <part> <commit> <base commit>`.
# part a: the CUDA tests; Nsight Compute's kernel times at 16384 for the new default.
# part b: fla and chunkscan side by side at 16384 and 65536, eager and compiled (the
#   default group budget, 4 GiB on the H200); the LoRA step at 8192 (stub and patched),
#   then the patched step once more (a second sample: run 59 and 60 differed by 3%).
# Outputs in $OUT/run62<part>.tgz.
source bench/device_run.sh 62 "$@"  # st, $BASE, $S, pack, ncu_kernels, cuda_tests, lora_8192
if [ "$1" = a ]; then
  st tests
  cuda_tests
  pack
  cd bench
  st ncu
  ncu_kernels new
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
  st lora_patched_again
  timeout 150 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$(cat bench/lora_4layer.json)" \
    --timeout 140 --T 8192 --modes patched --json $S/lora_h200_8192_patched2.json 2>&1 | tail -1
  pack
fi
st done
