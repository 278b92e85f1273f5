# Prepared in session 14: `bash <this> <commit> <base>`, base/ = `git archive <base> src`
# carried beside the tree (base: main before the launch plans were cached).
# - mx.device_info()'s cost per call (launches asked it for the compute capability);
# - bench/gpu_gaps.py new and base twice: how long eager's lazy graph takes to build;
# - the op at 16384, eager and compiled, new then base;
# - the peak under MLX's memory limit with small command graphs (MLX_MAX_MB_PER_BUFFER=64,
#   limit 256 MiB above the inputs, save_states="groups", 256 MiB groups);
# - last, the CUDA tests of both fused-kernel files (what is left of the call's time).
# Outputs in $OUT/run49a.tgz.
source bench/device_run.sh 49 a "$@"  # st, $BASE, $S, pack
st device_info
python3 -c "
import time, mlx.core as mx
mx.device_info()
t = time.perf_counter()
for _ in range(200):
    mx.device_info()
print(f'mx.device_info(): {(time.perf_counter() - t) / 200 * 1e6:.1f} us per call')
" | tee $S/device_info.txt
cd bench
st gaps
for i in 1 2; do
  timeout 60 python3 gpu_gaps.py --T 16384 2>&1 | grep -E "^(eager|compiled)" | sed 's/^/new  /'
  timeout 60 $BASE python3 gpu_gaps.py --T 16384 2>&1 | grep -E "^(eager|compiled)" | sed 's/^/base /'
done | tee $S/gpu_gaps.txt
pack
st op16k
timeout 60 python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 5 --json $S/gdn_16k_new_h200.json | grep -E "chunkscan|rror"
timeout 60 $BASE python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 5 --json $S/gdn_16k_base_h200.json | grep -E "chunkscan|rror"
pack
st memory
MLX_MAX_MB_PER_BUFFER=64 timeout 150 python3 gdn_vs_fla.py --T 16384 65536 --impls chunkscan \
  --modes compiled eager --chunk-sizes 64 --save groups --group-mib 256 --memory-limit-mib 256 \
  --repeats 3 --json $S/gdn_memory_mb64_h200.json | grep -E "chunkscan|rror"
pack
cd ..
st tests
MLX_ENABLE_TF32=0 timeout 230 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error" | tail -8
pack
st done
