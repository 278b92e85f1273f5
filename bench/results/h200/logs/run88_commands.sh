# Prepared in session 25 for the next session (not run: this session's device time was
# spent). Eager's time before the first kernel: at T = 16384 5.5-5.6 ms in the profiled
# call, of which the graph build is 2.0-2.2 (runs 84, 86); the rest is MLX's encoding up
# to its first commit, which on an H200 comes every 100 ops or 1000 MB
# (MLX_MAX_OPS_PER_BUFFER, MLX_MAX_MB_PER_BUFFER, read once per process). With commits
# every few ops the GPU would start after the first few and run while the rest are
# encoded. A process setting, not the op's: measure what it buys before documenting it.
# `bash <this> a <commit> <commit>`: bench/gpu_gaps.py at 16384 and 65536 and fla side by
# side at 16384 (eager and compiled) under MLX_MAX_OPS_PER_BUFFER unset, 50, 20 and 8;
# then, where nsys is installed, NVTX and CUDA API sums of one eager fwd+bwd.
# Outputs in $OUT/run88a.tgz.
source bench/device_run.sh 88 "$@"  # st, $S, pack
cd bench
for ops in default 50 20 8; do
  st "ops_$ops"
  if [ "$ops" = default ]; then unset MLX_MAX_OPS_PER_BUFFER; else export MLX_MAX_OPS_PER_BUFFER=$ops; fi
  timeout 60 python3 gpu_gaps.py --T 16384 2>&1 | grep -v -i warn | tee $S/gpu_gaps_16384_ops$ops.txt
  timeout 90 python3 gpu_gaps.py --T 65536 2>&1 | grep -v -i warn | tee $S/gpu_gaps_65536_ops$ops.txt
  timeout 120 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan --modes eager compiled \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_16384_ops$ops.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
  pack
done
unset MLX_MAX_OPS_PER_BUFFER
# Where eager's encoding goes, op by op, if Nsight Systems is on the machine (MLX marks
# each primitive's eval_gpu and its graph commits with NVTX ranges): one eager fwd+bwd at
# 16384 (ncu_op.py brackets it with cudaProfilerStart / Stop).
st nsys
if command -v nsys >/dev/null; then
  timeout 120 nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi --force-overwrite true \
    -o $S/nsys_eager_16k python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -2
  nsys stats --report nvtx_sum,cuda_api_sum $S/nsys_eager_16k.nsys-rep > $S/nsys_eager_16k.txt 2>&1
  head -60 $S/nsys_eager_16k.txt
else
  echo "no nsys on this machine"
fi
pack
st done
