# Run 124 (session 45): an H100 came (none of 25 set-up calls got an H200), with 416 s of
# device time left, after the set-up call (part.aa copied to /tmp/mlx). Run as one ad-hoc
# command (written here after it ran: the machine is given back ~30 s after a call):
# dplr_delta_rule's tests (four were added after run 121 and had not run on a GPU), then
# the seams' dtype tests this session added. Outputs: bench/results/h100/
# tests_h100_{dplr,seam_dtypes}_2c090a4.txt; the log: run124_2c090a4.txt.
test -f /tmp/mlx/part.aa || exit 3
source bench/device_setup.sh >/dev/null 2>&1
export CHUNKSCAN_COMMIT=2c090a4
mkdir -p $OUT/r124
nvidia-smi --query-gpu=name --format=csv,noheader
echo "=== dplr ($(date +%T))"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/test_dplr_delta.py -k "not memory" 2>&1 \
  | tee $OUT/r124/tests_h100_dplr_2c090a4.txt | tail -3
echo "=== seams ($(date +%T))"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_mlx_lm.py \
  -k "mixed_or_float64 or stay_mlx_lms or stays_mlx_lms or cache_or_sinks" 2>&1 \
  | tee $OUT/r124/tests_h100_seam_dtypes_2c090a4.txt | tail -3
echo "=== done ($(date +%T))"
