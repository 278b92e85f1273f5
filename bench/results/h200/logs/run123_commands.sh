# Run 123 (session 44): dplr_delta_rule alone on a GPU, eager and under mx.compile (does
# compiling the training step, which fuses the chunk's elementwise ops, cut the launches
# that bound it?), chunks of 32, beside mlx-lm's loop at T = 1024. After the set-up call,
# `bash <this> a <commit> 1b133f9`; outputs in $OUT/run123a.tgz.
source bench/device_run.sh 123 "$@"  # st, $S, pack
case "$RUN_PART" in
a)
  st eager
  timeout 150 python3 bench/dplr_delta.py --T 1024 4096 --impls chunkscan --dtype bfloat16 \
    --repeats 3 --json $S/dplr_gpu_eager.json --md $S/dplr_gpu_eager.md 2>&1 | grep -E "T=|rror"
  pack
  st compiled
  timeout 150 python3 bench/dplr_delta.py --T 1024 4096 --impls chunkscan --dtype bfloat16 \
    --compiled --repeats 3 --json $S/dplr_gpu_compiled.json --md $S/dplr_gpu_compiled.md \
    2>&1 | grep -E "T=|rror"
  pack
  st mlx_lm
  timeout 100 python3 bench/dplr_delta.py --T 1024 --impls mlx_lm --dtype bfloat16 \
    --repeats 3 --json $S/dplr_gpu_mlx_lm.json --md $S/dplr_gpu_mlx_lm.md 2>&1 | grep -E "T=|rror"
  pack
  ;;
esac
st done
