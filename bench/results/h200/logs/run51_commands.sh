# Session 15: `bash <this> <commit> <base commit>`, base/ = `git archive <base> src` carried
# beside the tree (base: main with state_grads in pieces, before prepare's products took
# the tensor cores). Outputs in $OUT/run51a.tgz.
# - Nsight Compute's kernel times at 16384: new; "wu" = new with prepare's kk / qk back on
#   the FMA loops (its CS_TC block compiled out in a copy of src/, so only w and u take
#   TF32: run 35 found kk / qk on the tensor cores no faster); base;
# - the CUDA tests of both fused-kernel files (their TF32 errors printed);
# - gpu_gaps at 16384, new and base.
source bench/device_run.sh 51 a "$@"  # st, $BASE, $S, pack, ncu_kernels
mkdir -p /tmp/wu && cp -r src /tmp/wu/ && python3 - <<'PY'
p = "/tmp/wu/src/chunkscan/ops/gated_delta/_chunk_cuda.py"
s = open(p).read()
key = "#ifdef CS_TC\n  {\n    // On the tensor cores (exact"
assert s.count(key) == 1
open(p, "w").write(s.replace(key, "#if 0\n  {\n    // On the tensor cores (exact"))
PY
cd bench
st ncu
ncu_kernels new
ncu_kernels wu PYTHONPATH=/tmp/wu/src:$PYTHONPATH CHUNKSCAN_CUDA_CACHE=/tmp/c_wu
BASE_ENV=${BASE#env }
ncu_kernels base $BASE_ENV
pack
st gaps
timeout 60 python3 gpu_gaps.py --T 16384 2>&1 | grep -E "^(eager|compiled)" | sed 's/^/new  /' | tee $S/gpu_gaps.txt
timeout 60 $BASE python3 gpu_gaps.py --T 16384 2>&1 | grep -E "^(eager|compiled)" | sed 's/^/base /' | tee -a $S/gpu_gaps.txt
pack
cd ..
st tests
MLX_ENABLE_TF32=0 timeout 240 python3 -m pytest -q -s -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py -k "cuda or tf32" 2>&1 \
  | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error|\{'o'" | tail -12
pack
st done
