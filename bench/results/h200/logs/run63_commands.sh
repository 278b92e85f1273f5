# Session 19, the last 249 s of device time: `bash <this>` after the copy call. The fused
# op against the oracle with the default slices and with two slices of Dv
# (CHUNKSCAN_GDN_TV=64), the test added after run 62. Output in $OUT/run63.txt.
source bench/device_setup.sh >/dev/null 2>&1
MLX_ENABLE_TF32=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/ops/test_gated_delta_fused.py -k "cuda_fused_matches_oracle" 2>&1 | tail -4 | tee $OUT/run63.txt
