# Run 130 (session 50): after the set-up call, `bash <this> b <commit> 1b133f9`; outputs in
# $OUT/run130b.tgz:
#   b: session 50's bench harness changes on the device (bench/_common.meta's argv and
#      scripts_commit, gdn_vs_fla.py's chunk_run and its printed line): one ten-repeat
#      side-by-side sample at T = 16384 (samples_16384 1), then the meta and chunk fields
#      of its JSON printed.
source bench/device_run.sh 130 "$@"  # st, $S, pack, samples_16384
case "$RUN_PART" in
b)
  cd bench
  samples_16384 1
  st meta
  python3 - "$S/gdn_vs_fla_16384_h200_r10_s1.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
m = d["meta"]
print({k: m.get(k) for k in ("argv", "commit", "git_commit", "scripts_commit", "device")})
for r in d["rows"]:
    print({k: r.get(k) for k in ("impl", "compiled", "ms", "kib_per_token", "chunk_size", "chunk_run")})
PY
  ;;
esac
st done
