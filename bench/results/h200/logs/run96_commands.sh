# Run 96 (session 30): a third sample at T = 16384 with ten repeats, on the machine run 95
# left warm (run 95's first side-by-side sample was cut by its 150 s limit while fla's
# and chunkscan's kernels compiled). `bash <this> <commit>`; the JSON goes to $OUT.
source bench/device_setup.sh >/dev/null 2>&1
cd bench
CHUNKSCAN_COMMIT=$1 CHUNKSCAN_CUDA_CACHE=/tmp/c_new timeout 110 python3 gdn_vs_fla.py --T 16384 \
  --impls fla chunkscan --modes eager compiled --chunk-sizes 64 --repeats 10 \
  --json $OUT/gdn_vs_fla_16384_h200_r10_s3.json | grep --line-buffered -E "fla|chunkscan|rror"
