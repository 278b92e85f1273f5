# Run 129 (session 50). Part c ran first: `bash bench/results/h200/logs/run127_commands.sh
# c 050678d 1b133f9` (run 119's part c, the LoRA step; log run129c_050678d.txt). After
# the set-up call, `bash <this> <part> <commit> 1b133f9`; outputs in $OUT/run129<part>.tgz:
#   a: second derivatives of chunkscan.attention on the GPU by route (a short call to
#      mx.fast, a long one with the kernels, one on the portable path; float32 and
#      bfloat16) against naive_attention (run129_attention_hvp.py), then the tests of
#      what session 50 changed that touch the GPU, memory tests aside;
#   b: one ten-repeat side-by-side sample at T = 16384 (samples_16384 1: fla and
#      chunkscan, eager and compiled, C = 64).
source bench/device_run.sh 129 "$@"  # st, $S, pack, samples_16384
case "$RUN_PART" in
a)
  st attention_hvp
  timeout 200 python3 bench/results/h200/logs/run129_attention_hvp.py 2>&1 | tee $S/attention_hvp.txt
  pack
  if [ -n "$RUN129_TESTS" ]; then
    st session50_tests
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -k "not memory" \
      $RUN129_TESTS 2>&1 | tee $S/tests_gpu_session50.txt | tail -15
    pack
  fi
  ;;
b)
  cd bench
  samples_16384 1
  ;;
esac
st done
