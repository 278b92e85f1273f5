#!/usr/bin/env bash
# The common start of a device run script (bench/results/h200/logs/run<N>_commands.sh
# from run 48 on; the earlier ones spell it out). Source it as
#     source bench/device_run.sh <N> <part> <commit> <base commit>
# It sets up the machine (bench/device_setup.sh) and defines:
#   st <stage>   prints a stage marker with the time;
#   $BASE        a prefix that runs a command on base/'s sources (`git archive <base> src`,
#                carried beside the tree) with their own kernel cache;
#   $S           the folder for this part's outputs, packed into $OUT/run<N><part>.tgz by
#   pack         (call it after each stage, so a run cut by its limit still returns them).
# CHUNKSCAN_COMMIT names the code in every JSON (the copied tree's git metadata does not).
source bench/device_setup.sh >/dev/null 2>&1
st() { echo "=== $1 ($(date +%T))"; }
RUN_N=$1 RUN_PART=$2
export CHUNKSCAN_COMMIT=$3 CHUNKSCAN_CUDA_CACHE=/tmp/c_new
BASE="env PYTHONPATH=$PWD/base/src:$PYTHONPATH CHUNKSCAN_COMMIT=$4 CHUNKSCAN_CUDA_CACHE=/tmp/c_base"
test -d base/src/chunkscan || echo "NO BASE"
S=/tmp/so$RUN_N$RUN_PART
mkdir -p "$S"
pack() { tar czf "$OUT/run$RUN_N$RUN_PART.tgz" -C "$S" . ; }
