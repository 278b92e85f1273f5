# Session 16, third machine: `bash <this> <commit> <base commit>` (base/ unused). Every
# TF32 product on mma.sync: the state pass (run 54) and now the chunk kernels' TcMM. The
# CUDA tests of both fused-kernel files, Nsight Compute at 16384 (new only: run 54 has the
# kernels before on this kind of machine), then fla and chunkscan side by side at 16384
# (65536 left out: 523 s of device time were left). Outputs in $OUT/run55a.tgz.
source bench/device_run.sh 55 a "$@"  # st, $BASE, $S, pack, ncu_kernels, cuda_tests
st tests
cuda_tests
pack
cd bench
st ncu
ncu_kernels new
pack
st fla
timeout 150 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_h200.json | grep -E "fla|chunkscan|rror"
pack
st done
