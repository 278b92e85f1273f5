# Run 97 (prepared in session 31, when no device was lent; not run yet). Session 31
# changed no kernel; it changed scan's backward (integer carry and params leaves left out
# of the vjp; xs and the ys cotangents cut with split_at), gated_delta_rule's portable
# backward (its groups cut with split_at; the fused path keeps its slices) and a warning
# where a given chunk_size is one the fused kernels skip on the GPU, the capture
# walk, the tree flattening (an nn.Module stays a leaf), chunkscan.ops' exports,
# CHUNKSCAN_CUDA_PRECOMPILE's check and tests/conftest.py (MLX_ENABLE_TF32=0 unless
# set). Session 32 added: gated_delta_rule checks the fused path's settings on every
# path, split's one piece goes through its custom function, the forward-only groups'
# compiled traces are kept per CPU thread count (the key is 0 on a GPU), scan gives
# f handles of its own on the params leaves and checks a stepwise axis against the
# ys leaves. In order of need:
#   the CUDA tests of the fused chunk kernels and attention's, and attention's portable
#   tests on the GPU (session 30's NaN-gradient fix of the blocked backward has not run
#   there yet);
#   scan's, checkpoint's and stepwise's tests on the GPU, their default device there, with
#   MLX_ENABLE_TF32 left to tests/conftest.py (three failed under TF32 in run 94);
#   two side-by-side samples at T = 16384 with ten repeats (the first on a fresh machine
#   compiles fla's and chunkscan's kernels: over 150 s in run 95).
# Two calls (one call has 600 s): `bash <this> a <commit> <base commit>` the tests,
# then `bash <this> b <commit> <base commit>` on the warm machine the samples. Outputs in
# $OUT/run97a.tgz and run97b.tgz.
source bench/device_run.sh 97 "$@"  # st, $S, pack, cuda_tests
if [ "$RUN_PART" = a ]; then
st cuda_tests
cuda_tests tests/ops/test_gated_delta_fused.py tests/ops/test_attention_cuda.py
pack
st attention_gpu
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/test_attention.py 2>&1 \
  | tee $S/tests_h200_attention_portable.txt | grep -E "passed|failed|^FAILED" | tail -6
pack
st scan_gpu
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_scan.py tests/test_checkpoint.py \
  tests/test_stepwise.py 2>&1 | tee $S/tests_h200_scan_checkpoint_stepwise.txt \
  | grep -E "passed|failed|^FAILED" | tail -6
pack
else
cd bench
for s in 1 2; do
  st "side_by_side_$s"
  timeout $((s == 1 ? 330 : 200)) python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan \
    --modes eager compiled \
    --chunk-sizes 64 --repeats 10 --json $S/gdn_vs_fla_16384_h200_r10_s$s.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
  pack
done
fi
st done
