# Run 91 (prepared in session 26, revised in session 27; not run yet). Two calls, on the
# code of session 27 (the launch plans kept per settings, the state pass's index arrays
# made once per group layout: the launch path of every fused kernel changed, the kernels
# did not) against session 26's (d1c4466) as base:
#   part a: the CUDA tests of the chunk kernels, the state passes and the rows (their
#           launches go through the changed code), then the eager graph build with the
#           real kernels, base and new alternately (bench/graph_build.py --real; on
#           this project's CPU with faked kernels: 0.31 -> 0.24 ms at 16384, 0.79 ->
#           0.60 at 65536);
#   part b: the side by side (a second sample of run 90: 1.94x / 2.17x compiled, 2.18x /
#           2.38x eager at 16384 / 65536), and at 65536 the group budget: the default
#           4096 MiB (four groups: three `prepare` launches again in the backward, 2.43
#           ms, and 24 joining copies, 0.97 ms, run 89) against 8192 (two groups) and
#           16384 (one), for what a larger budget would buy and cost.
# Revised in session 28 (still not run: no device): part a's CUDA tests now include
# test_cuda_second_derivatives (a second derivative with the kernels must fail with
# MLX's CustomKernel message; without them it must match the oracle: the portable
# backward now adds the saved states' cotangents) and, through the portable-path cases,
# the state pass's new `values` output (None on CUDA: the group recomputes V); part b
# first runs attention's CUDA tests (its blocked backward now zeroes the score gradient
# where the probability is zero).
# `bash <this> a|b <commit> d1c4466`. Outputs in $OUT/run91<part>.tgz.
source bench/device_run.sh 91 "$@"  # st, $BASE, $S, pack, cuda_tests
if [ "$RUN_PART" = a ]; then
  st cuda_tests
  cuda_tests
  pack
  st graph_build
  cd bench
  for T in 16384 65536; do
    for round in 1 2; do
      $BASE timeout 60 python3 graph_build.py --T $T --repeats 50 --real 2>&1 | tail -1 | sed 's/^/base /'
      timeout 60 python3 graph_build.py --T $T --repeats 50 --real 2>&1 | tail -1 | sed 's/^/new  /'
    done
  done | tee $S/graph_build_real.txt
  pack
else
  st attention_tests
  cuda_tests tests/ops/test_attention_cuda.py
  pack
  cd bench
  st fla65
  timeout 300 python3 gdn_vs_fla.py --T 65536 --impls fla chunkscan --modes compiled eager \
    --chunk-sizes 64 --repeats 3 --group-mib 0 8192 16384 --json $S/gdn_vs_fla_65536_groups_h200.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
  pack
  st fla16
  timeout 150 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan --modes compiled eager \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_16384_h200.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
  pack
fi
st done
