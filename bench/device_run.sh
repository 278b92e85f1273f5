#!/usr/bin/env bash
# The common start of a device run script (bench/results/h200/logs/run<N>_commands.sh
# from run 48 on; the earlier ones spell it out). Source it as
#     source bench/device_run.sh <N> <part> <commit> <base commit>
# It sets up the machine (bench/device_setup.sh) and defines:
#   st <stage>   prints a stage marker with the time;
#   $BASE        a prefix that runs a command on base/'s sources (`git archive <base> src`,
#                carried beside the tree) with their own kernel cache;
#   $S           the folder for this part's outputs, packed into $OUT/run<N><part>.tgz by
#   pack         (call it after each stage, so a run cut by its limit still returns them);
#   ncu_kernels <tag> [VAR=value ...]   (in bench/) Nsight Compute's kernel times of one
#                fwd+bwd at 16384 under those variables: $S/ncu_16k_sol_<tag>.csv.gz and
#                the by-name summary's first lines printed (all of it in
#                $S/ncu_16k_summary_<tag>.txt);
#   ncu_base     ncu_kernels for base/'s sources (tag "base").
#   cuda_tests [files]  (at the tree's root) the CUDA and TF32 tests of the kernel test
#                files (default: the chunk kernels', the state passes' and the rows') but
#                the emulated ones, TF32 off for the rest: $S/tests_h200_cuda.txt, its
#                summary and errors printed (the three files took past 300 s on a fresh
#                machine in run 78; the chunk kernels' alone 120-130 s, runs 79-80);
#   lora_8192    (at the tree's root) the LoRA step of the 4-layer model at T = 8192, stub
#                and patched: $S/lora_h200_8192.{json,md,png}.
#   samples_16384 <n>  (in bench/) n side-by-side samples at T = 16384, fla and chunkscan,
#                eager and compiled, C = 64, ten repeats, each marked and packed
#                ($S/gdn_vs_fla_16384_h200_r10_s<i>.json; the first has 330 s, as it compiles
#                fla's and chunkscan's kernels on a fresh machine, the others 200 s);
#   fla_side_by_side   (in bench/) fla and chunkscan at T = 16384 and 65536, eager and
#                compiled, C = 64, three repeats, gdn_vs_fla.py's default harness (from
#                session 26 the op alone, given the outputs' cotangents; before, the
#                loss's gradients): $S/gdn_vs_fla_h200.json, the rows printed.
#   source_counters <regex> <launches>   (in bench/) Nsight Compute's warp-stall samples
#                per source line of those kernels' first launches at 16384 (built with
#                line info): $S/ncu_src_cuda_sass.csv.gz (run scripts 71, 72 and 75 wrote
#                this out);
#   kernel_checks  (at the tree's root; returns there) what a kernel change is run with:
#                cuda_tests, then kernel_timings: ncu_kernels new, ncu_base and the phase
#                clocks ($S/gdn_profile_C64.json), each stage marked and packed (run
#                scripts 68, 69, 72 and 73 wrote these stages out).
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
ncu_kernels() {
  local tag=$1; shift
  env "$@" timeout 90 ncu --profile-from-start off --clock-control none --csv --page raw \
    --section SpeedOfLight --log-file $S/ncu_16k_sol_$tag.csv \
    python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
  # the whole summary to a file, its first lines printed (a pipe into head broke it off:
  # run scripts 57-59 filtered the BrokenPipeError traceback out)
  python3 ncu_summary.py $S/ncu_16k_sol_$tag.csv --by-name > $S/ncu_16k_summary_$tag.txt 2>&1
  head -8 $S/ncu_16k_summary_$tag.txt
  gzip -f $S/ncu_16k_sol_$tag.csv
}
ncu_base() { ncu_kernels base ${BASE#env }; }  # (in bench/) the same for base/'s sources
cuda_tests() {  # (the emulated tests, run on every machine with g++, are left to CI)
  local files=("$@")
  [ ${#files[@]} -gt 0 ] || files=(tests/ops/test_gated_delta_fused.py
    tests/ops/test_gated_delta_passes.py tests/ops/test_gated_delta_rows.py)
  MLX_ENABLE_TF32=0 timeout 420 python3 -m pytest -q -s -p no:cacheprovider -rs "${files[@]}" \
    -k "(cuda or tf32) and not emulated" 2>&1 \
    | tee $S/tests_h200_cuda.txt | grep -E "passed|failed|^FAILED|Error|\{'o'" | tail -12
}
lora_8192() {
  local cfg
  cfg=$(cat bench/lora_4layer.json)  # the 4-layer model (as bench/h200_suite.sh)
  timeout 280 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config "$cfg" --timeout 250 \
    --T 8192 --modes stub patched --json $S/lora_h200_8192.json 2>&1 | tail -3
}
fla_side_by_side() {
  timeout 300 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
    --chunk-sizes 64 --repeats 3 --json $S/gdn_vs_fla_h200.json \
    | grep --line-buffered -E "fla|chunkscan|rror"
}
samples_16384() {
  local s
  for s in $(seq 1 "$1"); do
    st "side_by_side_$s"
    timeout $((s == 1 ? 330 : 200)) python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan \
      --modes eager compiled --chunk-sizes 64 --repeats 10 \
      --json $S/gdn_vs_fla_16384_h200_r10_s$s.json | grep --line-buffered -E "fla|chunkscan|rror"
    pack
  done
}
source_counters() {
  CHUNKSCAN_CUDA_LINEINFO=1 CHUNKSCAN_CUDA_CACHE=/tmp/c_li timeout 200 ncu --profile-from-start off \
    --clock-control none --section SourceCounters --import-source yes \
    --kernel-name regex:"$1" --launch-count "$2" \
    -o $S/ncu_src python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -1
  ncu -i $S/ncu_src.ncu-rep --page source --csv --print-source cuda,sass > $S/ncu_src_cuda_sass.csv 2>&1
  gzip -f $S/ncu_src_cuda_sass.csv
  rm -f $S/ncu_src.ncu-rep
}
kernel_timings() {  # (at the tree's root; returns there) kernel_checks but its tests
  cd bench || return
  st ncu
  ncu_kernels new
  pack
  st ncu_base
  ncu_base
  pack
  st profile
  timeout 60 python3 gdn_fused_kernels.py --profile --C 64 --json $S/gdn_profile_C64.json 2>&1 \
    | grep -v CSPROF
  pack
  cd ..
}
kernel_checks() {
  st tests
  cuda_tests
  pack
  kernel_timings
}
