# Run 110 (session 39): attention's CUDA tests after the blocked ops took float32 scores
# (e353172: the tests bound the kernels' error by 2x the blocked ops', now smaller), and
# the side by side at 16384 with state_grads' overlapped loads (d10ceb9), against base
# 5085d42 (base/ holds `git archive 5085d42 src`). After the set-up call, `bash <this>
# <part> <commit> 5085d42`; outputs in $OUT/run110<part>.tgz:
#   a: the CUDA tests of attention (cuda_tests), then one side-by-side sample at T =
#      16384 beside fla, ten repeats (samples_16384 1);
#   b: base's side by side at 16384 (the same command on base/'s sources).
source bench/device_run.sh 110 "$@"  # st, $S, $BASE, pack, cuda_tests, samples_16384
case "$RUN_PART" in
a)
  st tests
  cuda_tests tests/ops/test_attention_cuda.py
  pack
  cd bench
  samples_16384 1
  ;;
b)
  cd bench
  st side_by_side_base
  $BASE timeout 250 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan --modes eager \
    compiled --chunk-sizes 64 --repeats 10 --json $S/gdn_vs_fla_16384_h200_r10_base.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
  pack
  ;;
esac
st done
