# Run 88 (session 26). Eager's time before the first kernel: at T = 16384 5.5-5.6 ms in
# the profiled call, of which the graph build is 2.0-2.2 (runs 84, 86); the rest is MLX's
# encoding up to its first commit, which on an H200 comes every 100 ops or 1000 M input
# elements (MLX_MAX_OPS_PER_BUFFER, MLX_MAX_MB_PER_BUFFER, read once per process): an
# eager fwd+bwd at 16384 launches about 43 kernels, so the GPU starts only once all are
# encoded. (1) What one launch costs the CPU, by kind and by the size of a precompiled
# binary (MLX hashes a custom kernel's whole source, the cubin, at every evaluation);
# (2) bench/gpu_gaps.py at 16384 and 65536 under MLX_MAX_OPS_PER_BUFFER unset, 8 and 20,
# and fla side by side (16384, 65536; eager and compiled) under 8. The Nsight Systems
# stage prepared in session 25 is gone: nsys is not on the machine (run 47).
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run88a.tgz.
source bench/device_run.sh 88 "$@"  # st, $S, pack
cd bench
st launch_cost
timeout 120 python3 launch_cost.py --launches 400 --pads 64 128 256 1024 --real 2>&1 \
  | grep -v -i warn | tee $S/launch_cost.txt
pack
for ops in default 8 20; do
  st "ops_$ops"
  if [ "$ops" = default ]; then unset MLX_MAX_OPS_PER_BUFFER; else export MLX_MAX_OPS_PER_BUFFER=$ops; fi
  timeout 60 python3 gpu_gaps.py --T 16384 2>&1 | grep -v -i warn | tee $S/gpu_gaps_16384_ops$ops.txt
  timeout 90 python3 gpu_gaps.py --T 65536 2>&1 | grep -v -i warn | tee $S/gpu_gaps_65536_ops$ops.txt
  if [ "$ops" = 8 ]; then
    timeout 240 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
      --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_ops$ops.json \
      | grep --line-buffered -E "fla|chunkscan|rror"
  fi
  pack
done
unset MLX_MAX_OPS_PER_BUFFER
st done
