# Run 99 (session 34), after run 98 (83b00eb, on an H100). Two things:
#   the six per-channel tests that run 98's oracle stage left out (its `timeout 240` cut
#   them): tests/ops/test_gated_delta_channel.py's compiled/groups, non-finite and
#   backward-memory cases;
#   a check of bench/memory_breakdown.py's reading (the peak on CUDA is the sum of every
#   buffer the call's kernels allocate: 296.8 KiB/token counted at T = 16384 against
#   297.2 measured): chunkscan alone, eager, three repeats, at configurations where the
#   count differs (T = 8192: 297.3; T = 16384 with four groups of 1024 MiB: 342.9; C = 32:
#   432.8; T = 32768: 296.5), each printed beside its count on the device.
# The code measured is a copy of the commit named (`git archive <commit> src bench tests
# pyproject.toml` in head/, carried; the working tree may hold others' unfinished edits).
# One call after the set-up call: `bash <this> a <commit> <base commit>`; outputs in
# $OUT/run99a.tgz.
source bench/device_run.sh 99 "$@"  # st, $S, pack
cd head
st channel_tests_rest
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/test_gated_delta_channel.py \
  -k "compiled_and_groups or non_finite_input_is_causal or backward_memory_is_linear" 2>&1 \
  | tee $S/tests_channel_rest.txt | grep -E "passed|failed|^FAILED" | tail -4
pack
cd bench
st breakdown_check
for a in "--T 8192" "--T 16384 --group-mib 1024" "--T 16384 --chunk-size 32" "--T 32768"; do
  tag=$(echo $a | tr -d '-' | tr ' ' '_')
  python3 memory_breakdown.py $a --json $S/memory_breakdown_$tag.json | head -1
  c=64; case "$a" in *chunk-size*) c=32;; esac
  m=0; case "$a" in *group-mib*) m=1024;; esac
  T=$(echo $a | awk '{print $2}')
  timeout 150 python3 gdn_vs_fla.py --T $T --impls chunkscan --modes eager --chunk-sizes $c \
    --group-mib $m --repeats 3 --json $S/gdn_peak_$tag.json 2>&1 | grep -E "KiB|rror" | tail -2
  pack
done
st done
