# Session 16: `bash <this> <part> <commit> <base commit>`, base/ = `git archive <base> src`
# carried beside the tree (main before this session's changes).
# part a: Nsight Compute at 16384, new (the state pass's tensor-core kernel at 64 rows per
#   block with TF32 products; output with q, w, S in pieces of 32 columns of Dk, load_tile's
#   loads in flight sized to the tile), new with CHUNKSCAN_PASS_TC_TR=32 (the state pass as
#   before) and base; then the CUDA tests of both fused-kernel files.
# part b: the op's timer at 16384 new and base alternating twice, then fla and chunkscan
#   side by side at 16384 and 65536.
# part c: the LoRA step at 8192.
# Outputs in $OUT/run53<part>.tgz.
source bench/device_run.sh 53 "$@"  # st, $BASE, $S, pack, ncu_kernels, cuda_tests, lora_8192
if [ "$1" = a ]; then
  cd bench
  st ncu
  ncu_kernels new
  ncu_kernels tr32 CHUNKSCAN_PASS_TC_TR=32
  BASE_ENV=${BASE#env }
  ncu_kernels base $BASE_ENV
  pack
  cd ..
  st tests
  cuda_tests
  pack
elif [ "$1" = b ]; then
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
else
  st lora
  lora_8192
  pack
fi
st done
