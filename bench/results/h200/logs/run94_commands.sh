# Run 94 (session 30): the code after session 30's fixes of silent wrong results (scan's
# in-place carry and constants' anchor, checkpoint's integer arguments under a second
# derivative, attention's array mask as an input of its custom function). One call:
#   attention's CUDA tests (the blocked form with an array mask runs there; the kernels
#   take no array masks); scan's, checkpoint's and attention's portable tests on the GPU
#   (the default device there); the side by side at 16384 and 65536, three samples
#   (every configuration in a fresh process), for the eager ratio at 16384 (2.11x and
#   2.28x in run 92) on more than two samples.
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run94a.tgz.
source bench/device_run.sh 94 "$@"  # st, $S, pack, fla_side_by_side
st attention_cuda
cuda_tests tests/ops/test_attention_cuda.py
pack
st gpu_tests
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_scan.py tests/test_checkpoint.py \
  tests/test_stepwise.py tests/ops/test_attention.py 2>&1 | tail -4 | tee $S/tests_h200_gpu_default.txt
pack
cd bench
for i in 1 2 3; do
  st "side_by_side_$i"
  fla_side_by_side
  mv $S/gdn_vs_fla_h200.json $S/gdn_vs_fla_16384_65536_h200_s$i.json
  pack
done
st done
