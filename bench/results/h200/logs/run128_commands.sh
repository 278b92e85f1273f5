# Run 128 (session 49): the short-call path of chunkscan.attention on the GPU after
# 1103ef3: bfloat16 / float16 calls below FAST_MAX_SCORES go to mx.fast on their float32
# upcast (run 127 found mx.fast's own bfloat16 backward off on CUDA; the first fix, the
# kernels for such calls, lost mx.vmap / mx.jvp there). After the set-up call,
# `bash <this> a <commit> 1b133f9`; outputs in $OUT/run128a.tgz:
#   a: run 127's part a tests again (memory aside; test_errors_are_pinned deselected: it
#      builds a float64 mask on the GPU, test-side), then bench/attention.py at T = 512
#      and 1024, Qwen3-Next's attention shape in bfloat16: the default (the upcast
#      shortcut), the kernels (--fast-max-scores 0), each beside mx.fast's own bf16 call.
source bench/device_run.sh 128 "$@"  # st, $S, pack
case "$RUN_PART" in
a)
  st tests
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
    -k "not memory and not errors_are_pinned" \
    tests/ops/test_selective_scan.py tests/ops/test_attention.py \
    "tests/test_scan.py::test_a_module_the_params_module_s_call_reads_warns" \
    "tests/test_scan.py::test_one_block_under_two_names_is_no_replacement" \
    tests/test_mlx_lm.py::test_float64_attention_and_numpy_scales_go_to_stock \
    tests/test_mlx_lm.py::test_attention_with_cache_or_sinks_goes_to_stock \
    2>&1 | tee $S/tests_gpu_session49b.txt | tail -8
  pack
  st attention_short
  cd bench
  for f in 1048576 0; do
    timeout 120 python3 attention.py --shape qwen3-next --T 512 1024 --impls chunkscan mlx_fast \
      --repeats 5 --timeout 60 --fast-max-scores $f --json $S/attention_short_fms$f.json \
      2>&1 | grep -E "^\|"
  done
  cd ..
  pack
  ;;
esac
st done
