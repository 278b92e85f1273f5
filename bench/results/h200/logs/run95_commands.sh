# Run 95 (session 30): the eager graph build trimmed (a call's backward takes the settings
# its forward read; no import per launch; the launch's binary key built from lists; the
# state pass's stored states as slices, not gathers). On this project's CPU with the
# launches stubbed (mx.fast.precompiled_cuda_kernel returning lazy zeros) the build went
# from 0.33-0.34 ms to 0.28 at T = 16384. One call, in order of need:
#   the CUDA tests of the fused chunk kernels (every launch goes through the changed
#   path) and attention's; the side by side at 16384 and 65536 with ten repeats per
#   configuration (earlier runs: three); the graph build with the real kernels, base
#   (run 94's code, 1b63603's src) against this code, alternately; scan's
#   second-derivative test on the GPU with TF32 off and on (three of the first tests of
#   tests/test_scan.py failed on the GPU, its default device there, in run 94); a second
#   side-by-side sample.
# `bash <this> a <commit> <base commit>`. Outputs in $OUT/run95a.tgz.
source bench/device_run.sh 95 "$@"  # st, $BASE, $S, pack, cuda_tests
side_by_side() {
  st "side_by_side_$1"
  timeout 150 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
    --chunk-sizes 64 --repeats 10 --json $S/gdn_vs_fla_16384_65536_h200_r10_s$1.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
  pack
}
st cuda_tests
cuda_tests tests/ops/test_gated_delta_fused.py tests/ops/test_attention_cuda.py
pack
cd bench
side_by_side 1
st build
for i in 1 2; do
  $BASE timeout 60 python3 graph_build.py --T 16384 --repeats 100 --group-mib 16384 --real | tail -1 | sed 's/^/base: /'
  timeout 60 python3 graph_build.py --T 16384 --repeats 100 --group-mib 16384 --real | tail -1 | sed 's/^/new:  /'
done 2>&1 | tee $S/graph_build_h200.txt
pack
cd ..
st scan_gpu
MLX_ENABLE_TF32=0 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_scan.py \
  -k second_derivatives 2>&1 | tail -2 | tee $S/tests_h200_scan_second_tf32_off.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_scan.py -k second_derivatives \
  2>&1 | grep -E "passed|failed|rel|Error" | tail -6 | tee $S/tests_h200_scan_second_tf32_on.txt
pack
cd bench
side_by_side 2
st done
