# Session 23, first run: the review's helpers (branch wip/helpers-76: load_tile's and
# csg::TileLoad's 16-byte rounds from issue16 / land16, csg::finite_input, the state
# pass's cs_copy_rows and stage_scalars, inverse_level's product helper; bitwise the
# values before in the emulator, their SASS differs) timed against main (base/, 6f35f7c:
# the kernels of runs 72-74); `output` at 64 columns and 256 threads (two blocks a
# multiprocessor); where `output` and `prepare` wait (SourceCounters, never taken for
# them at the current code). The CUDA tests are left to the session's last run.
# `bash <this> a <commit> 6f35f7c`. Outputs in $OUT/run75a.tgz.
source bench/device_run.sh 75 "$@"  # st, $BASE, $S, pack, ncu_kernels, ...
cd bench
st ncu
ncu_kernels new
pack
st ncu_base
ncu_base
pack
st ncu_tv64
ncu_kernels tv64nt256 CHUNKSCAN_GDN_TV=64 CHUNKSCAN_GDN_NT=256
pack
st profile
timeout 60 python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64.json 2>&1 \
  | grep -v CSPROF
pack
st source
CHUNKSCAN_CUDA_LINEINFO=1 CHUNKSCAN_CUDA_CACHE=/tmp/c_li timeout 200 ncu --profile-from-start off \
  --clock-control none --section SourceCounters --import-source yes \
  --kernel-name regex:"gdn_output|gdn_prepare" --launch-count 4 \
  -o $S/ncu_src python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
ncu -i $S/ncu_src.ncu-rep --page source --csv --print-source cuda,sass > $S/ncu_src_cuda_sass.csv 2>&1
gzip -f $S/ncu_src_cuda_sass.csv; rm -f $S/ncu_src.ncu-rep
pack
st done
