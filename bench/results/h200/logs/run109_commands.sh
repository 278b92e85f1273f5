# Run 109 (session 39): state_grads with each piece's loads behind the products of the
# piece before (d10ceb9; emulator-tested, the emulator's copies now landing at their
# waits). Base: 5085d42 (base/ holds `git archive 5085d42 src`: run 108's kernels).
# After the set-up call, `bash <this> <part> <commit> 5085d42` (the commit written out);
# outputs in $OUT/run109<part>.tgz:
#   a: the CUDA tests of the fused chunk kernels and of the rows (cuda_tests), then
#      Nsight Compute's kernel times of one fwd+bwd at 16384, this code and base
#      (ncu_kernels new, ncu_base);
#   b: two side-by-side samples at T = 16384 beside fla, ten repeats (samples_16384),
#      then base's side by side at 16384 (one sample, the same command on base/'s
#      sources).
source bench/device_run.sh 109 "$@"  # st, $S, $BASE, pack, ncu_kernels, ncu_base, ...
case "$RUN_PART" in
a)
  st tests
  cuda_tests tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_rows.py
  pack
  cd bench
  st ncu
  ncu_kernels new
  pack
  st ncu_base
  ncu_base
  pack
  ;;
b)
  cd bench
  samples_16384 2
  st side_by_side_base
  $BASE timeout 200 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan --modes eager \
    compiled --chunk-sizes 64 --repeats 10 --json $S/gdn_vs_fla_16384_h200_r10_base.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
  pack
  ;;
esac
st done
