# Prepared in session 16 for the next machine (not run yet): `bash <this> <part> <commit>
# <base commit>`, base/ = `git archive <base> src` carried beside the tree (28dde7b: main
# before session 16's mma.sync products).
# part a: fla and chunkscan side by side at 16384 and 65536, eager and compiled (run 55's
#   call was cut after the eager rows at 16384), then the op's timer at 16384 new and
#   base alternating twice.
# part b: the LoRA step at 8192 (1.62x the stub in run 50, before sessions 15 and 16).
# Outputs in $OUT/run56<part>.tgz.
source bench/device_run.sh 56 "$@"  # st, $BASE, $S, pack, lora_8192
if [ "$1" = a ]; then
  cd bench
  st fla
  timeout 330 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_h200.json | grep --line-buffered -E "fla|chunkscan|rror"
  pack
  st op16k
  for i in 1 2; do
    timeout 60 python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes compiled eager \
      --chunk-sizes 64 --repeats 5 --json $S/gdn_16k_new_$i.json | grep --line-buffered -E "chunkscan|rror" | sed 's/^/new /'
    timeout 60 $BASE python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes compiled eager \
      --chunk-sizes 64 --repeats 5 --json $S/gdn_16k_base_$i.json | grep --line-buffered -E "chunkscan|rror" | sed 's/^/base/'
  done
  pack
else
  st lora
  lora_8192
  pack
fi
st done
