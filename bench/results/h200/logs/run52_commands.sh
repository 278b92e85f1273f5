# Prepared in session 15 for the next machine and never run (session 16 ran run 53-55 instead;
# its part c, output in pieces, ran in run 53): `bash <this> <part> <commit> <base commit>`,
# base/ = `git archive <base> src` carried beside the tree.
# part a (main, base/ = e590d34: before prepare's products took the tensor cores): the op's
#   timer at 16384 new and base alternating twice (run 51 measured prepare under Nsight
#   Compute only); then fla and chunkscan side by side at 16384 and 65536.
# part b: the LoRA step at 8192 (run 50's 1.62x was before prepare's change).
# part c (working tree = branch wip/output-pieces rebased onto main, base/ = main): Nsight
#   Compute new and base (output with q, w, S in pieces: 62.0 KiB and, with load_tile's
#   loads in flight sized to the tile, 80 registers in NVRTC for bf16 with TF32, so three
#   blocks per multiprocessor; load_tile's change reaches every kernel), and the CUDA tests
#   of both fused-kernel files.
# Outputs in $OUT/run52<part>.tgz.
source bench/device_run.sh 52 "$@"  # st, $BASE, $S, pack, ncu_kernels, cuda_tests, lora_8192
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
  lora_8192
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
  cuda_tests
  pack
fi
st done
