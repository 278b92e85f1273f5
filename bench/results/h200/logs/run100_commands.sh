# Run 100 (session 34), after run 99 (b36762f): one more side-by-side sample at
# T = 16384 with ten repeats (eager has sat at 1.89-2.20x fla in runs 95-99), on the code
# after this session's bench-script changes (the argument checks of gdn_vs_fla.py run on
# the device for the first time). One call after the set-up call:
# `bash <this> a <commit> <base commit>`; outputs in $OUT/run100a.tgz.
source bench/device_run.sh 100 "$@"  # st, $S, pack, samples_16384
cd bench
samples_16384 1
st done
