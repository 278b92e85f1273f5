# Run 116 (session 41): issue 9's figures on the session's last code (the kernels as
# since run 110; session 41 changed the Python that picks them). After the set-up call,
# `bash <this> <part> <commit> 1b133f9` (base/ is not used); outputs in $OUT/run116<part>.tgz:
#   a: fla and chunkscan side by side at T = 16384 and 65536, eager and compiled, C = 64
#      (fla_side_by_side), then the portable path (kernels off) at 16384, C = 128;
#   b: the LoRA step of the 4-layer model at T = 8192, stub and patched (lora_8192).
source bench/device_run.sh 116 "$@"  # st, $S, pack, fla_side_by_side, lora_8192
case "$RUN_PART" in
a)
  cd bench
  st side_by_side
  fla_side_by_side
  pack
  st portable
  timeout 200 python3 gdn_vs_fla.py --T 16384 --impls chunkscan-portable --modes compiled eager \
    --chunk-sizes 128 --repeats 3 --json $S/gdn_portable_16384_h200.json \
    | grep --line-buffered -E "chunkscan|rror"
  pack
  ;;
b)
  st lora
  lora_8192
  pack
  ;;
esac
st done
