# Run 93 (prepared in session 29, run in session 30 with two more stages: the graph
# build timed with the kernels faked and real on the device's CPU, and Nsight Compute's
# kernel times of the current code). The portable path (kernels off) at T = 16384 on the current code,
# last measured in run 77 (47.8 ms eager, 34.5 compiled; target: at most 60). Since then
# the portable state pass returns V where it forms it (session 28; on CUDA it forms none)
# and the CUDA group budget grew to 1/8 of the GPU's memory (run 92): with C = 128 the
# sequence is one group (128 chunks) where it was two. Then a third sample of the side
# by side at 16384 (the eager ratio was 2.11x and 2.28x in run 92). First attention's
# CUDA tests: its blocked form's array masks now keep -inf scores (no clamp).
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run93a.tgz.
source bench/device_run.sh 93 "$@"  # st, $S, pack
st attention_tests
cuda_tests tests/ops/test_attention_cuda.py
pack
cd bench
st portable
timeout 200 python3 gdn_vs_fla.py --T 16384 --impls chunkscan-portable --modes compiled eager \
  --chunk-sizes 128 --repeats 3 --json $S/gdn_portable_16384_h200.json \
  | grep --line-buffered -E "chunkscan|rror"
pack
st fla16
timeout 90 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan --modes compiled eager \
  --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_16384_h200.json \
  | grep --line-buffered -E "fla|chunkscan|rror"
pack
st build
python3 graph_build.py --T 16384 --repeats 50 --group-mib 16384 | tail -1
python3 graph_build.py --T 16384 --repeats 50 --group-mib 16384 --real | tail -1
python3 graph_build.py --T 16384 --repeats 50 --group-mib 16384 --real --profile 60 \
  > $S/graph_build_profile_h200.txt 2>&1
pack
st ncu
ncu_kernels new
pack
st done
