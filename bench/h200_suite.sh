#!/usr/bin/env bash
# The H200 figures of the docs. In this workplace run it after
# `source bench/device_setup.sh`; on any CUDA machine with `pip install -e
# '.[cuda,lm,test]' fla-core==0.6.0` run it as it is. Writes into ${OUT:-bench-out}.
#
#     bash bench/h200_suite.sh                 # every stage (more than one 10-minute call)
#     bash bench/h200_suite.sh tests gdn       # the stages named (see STAGES below)
#
# Each stage has a time limit. fla's rows come first where both run, so that a
# stage's --budget cuts chunkscan's extra rows, not the side-by-side baseline. How long stages took on the H200 (the stage lines carry
# clock times): bench/results/h200/logs/; "tests" is tests_attention and tests_gdn.
OUT=${OUT:-bench-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
STAGES=${*:-tests first_call gdn_now memfloor lora_now pass attention crossover attention_kernels attention_fwd channel channel_mlx_lm kda phases groups}
stage() { echo "=== $1 ($(date +%T))"; }
want() { [[ " $STAGES " == *" $1 "* ]]; }

# TF32 off in the test stages: the fp32 tolerances are those of exact fp32 matmuls
PYTEST="timeout 300 python3 -m pytest -q -s -p no:cacheprovider -rs"
if want tests || want tests_attention; then
  stage tests_attention  # ~40 s
  MLX_ENABLE_TF32=0 $PYTEST tests/ops/test_attention_cuda.py tests/ops/test_attention.py \
    2>&1 | tee "$OUT/tests_h200_attention.txt" | tail -4
fi
if want tests || want tests_gdn; then
  stage tests_gdn  # can use its whole 300 s: the GPU tests compile many kernel templates
  MLX_ENABLE_TF32=0 $PYTEST tests/ops/test_gated_delta_fused.py tests/ops/test_gated_delta_passes.py \
    "tests/ops/test_gated_delta.py::test_fp32_matches_oracle" \
    "tests/ops/test_gated_delta.py::test_packed_sequences" \
    "tests/ops/test_gated_delta.py::test_low_precision_is_the_float32_call_rounded" \
    tests/ops/test_gated_delta_channel.py tests/test_backend.py \
    2>&1 | tee "$OUT/tests_h200_gdn.txt" | tail -4
fi
if want fused; then
  stage fused  # issue 9: the fused chunk kernels' CUDA tests, then each kernel timed alone
  # (the emulated tests run on every machine with g++: the CUDA ones here)
  MLX_ENABLE_TF32=0 timeout 150 python3 -m pytest -q -x -s -p no:cacheprovider -rs \
    tests/ops/test_gated_delta_fused.py -k "cuda or supports or dispatch or scratch" 2>&1 \
    | tee "$OUT/tests_h200_fused.txt" | tail -6
  for C in 64 32; do
    timeout 60 python3 bench/gdn_fused_kernels.py --tokens 4096 --C $C \
      --json "$OUT/gdn_fused_kernels_C${C}_h200.json"
  done
fi
if want gdn_mem; then
  stage gdn_mem  # fused kernels: chunk size, and MLX's command-buffer size against memory
  for mb in default 64; do
    if [ "$mb" = default ]; then unset MLX_MAX_MB_PER_BUFFER; else export MLX_MAX_MB_PER_BUFFER=$mb; fi
    (cd bench && timeout 120 python3 gdn_vs_fla.py --T 16384 --impls chunkscan --modes eager \
      --chunk-sizes 64 32 --repeats 3 --timeout 55 --json "$OUT/gdn_mem_${mb}_h200.json") \
      | grep -E "chunkscan|rror"
  done
  unset MLX_MAX_MB_PER_BUFFER
fi
if want ncu; then
  stage ncu  # Nsight Compute (bench/ncu_op.py): every kernel of one chunkscan fwd+bwd at 16384
  # (times only), chunkscan's own kernels in full at 4096, fla's kernels in full at 16384
  N="ncu --profile-from-start off --clock-control none --csv --page raw"
  FULL="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
  FULL="$FULL --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
  (cd bench
   timeout 150 $N --section SpeedOfLight --log-file "$OUT/ncu_chunkscan_16k_sol.csv" \
     python3 ncu_op.py --impl chunkscan --T 16384 2>&1 | tail -2
   python3 ncu_summary.py "$OUT/ncu_chunkscan_16k_sol.csv" --by-name --top 30
   timeout 150 $N $FULL --kernel-name regex:chunkscan_ --log-file "$OUT/ncu_chunkscan_4k_full.csv" \
     python3 ncu_op.py --impl chunkscan --T 4096 2>&1 | tail -2
   python3 ncu_summary.py "$OUT/ncu_chunkscan_4k_full.csv"
   timeout 280 $N $FULL --log-file "$OUT/ncu_fla_16k_full.csv" \
     python3 ncu_op.py --impl fla --T 16384 2>&1 | tail -2
   python3 ncu_summary.py "$OUT/ncu_fla_16k_full.csv" --by-name --top 30)
fi
if want tc_pass; then
  stage tc_pass  # the tensor-core state pass in both directions (CHUNKSCAN_PASS_TC=1): its
  # CUDA tests, the pass beside the FMA kernel, then the op at 16384 with it
  CHUNKSCAN_PASS_TC=1 MLX_ENABLE_TF32=0 timeout 150 python3 -m pytest -q -s -p no:cacheprovider \
    -rs tests/ops/test_gated_delta_passes.py -k cuda 2>&1 | tee "$OUT/tests_h200_tc_pass.txt" | tail -3
  for tc in 0 1; do
    CHUNKSCAN_PASS_TC=$tc timeout 60 python3 bench/state_pass.py --n 256 --tr 16 --runs 7 \
      --skip-portable-above 0 --out "$OUT/state_pass_tc${tc}_h200.json" 2>&1 | grep "^| kernel"
  done
  for m in compiled eager; do
    (cd bench && CHUNKSCAN_PASS_TC=1 timeout 45 python3 gdn_vs_fla.py --T 16384 --repeats 5 \
      --impls chunkscan --chunk-sizes 64 --modes $m --json "$OUT/gdn_16k_${m}_tc_h200.json") \
      | grep -E "chunkscan|rror"
  done
fi
if want tc_tune; then
  stage tc_tune  # the tensor-core pass's tiling: rows per block (16: twice the blocks, two to a
  # multiprocessor at 32-row pieces) x rows per piece; its CUDA tests at 16 rows first
  CHUNKSCAN_PASS_TC=1 CHUNKSCAN_PASS_TC_TR=16 MLX_ENABLE_TF32=0 timeout 100 python3 -m pytest -q \
    -p no:cacheprovider tests/ops/test_gated_delta_passes.py -k "cuda and tc" 2>&1 | tail -1
  for cfg in "32 64" "32 32" "16 64" "16 32"; do
    set -- $cfg
    echo "--- TR=$1 CP=$2"
    CHUNKSCAN_PASS_TC=1 CHUNKSCAN_PASS_TC_TR=$1 CHUNKSCAN_PASS_TC_CP=$2 timeout 40 \
      python3 bench/state_pass.py --n 256 --tr 16 --runs 7 --skip-portable-above 0 \
      --out "$OUT/state_pass_tc_tr$1_cp$2_h200.json" 2>&1 | grep -E "^\| kernel|rror"
  done
fi
if want tune; then
  stage tune  # the chunk kernels' threads per block (NT) and state_grads' columns (TV)
  for C in 64 32; do
    for cfg in "256 32" "512 32" "256 64" "512 64"; do
      set -- $cfg
      echo "--- C=$C NT=$1 TV=$2"
      CHUNKSCAN_GDN_NT=$1 CHUNKSCAN_GDN_TV=$2 timeout 60 python3 bench/gdn_fused_kernels.py \
        --tokens 4096 --C $C --json "$OUT/gdn_tune_C${C}_nt$1_tv$2_h200.json"
    done
  done
fi
if want profile; then
  stage profile  # phase clocks of the chunk kernels (thread 0 of four blocks, cycles)
  for cfg in "64 256 32" "64 512 64" "32 256 32"; do
    set -- $cfg
    echo "--- C=$1 NT=$2 TV=$3"
    CHUNKSCAN_GDN_NT=$2 CHUNKSCAN_GDN_TV=$3 timeout 60 python3 bench/gdn_fused_kernels.py \
      --profile --tokens 4096 --C $1 --json "$OUT/gdn_profile_C$1_nt$2_tv$3_h200.json"
  done
fi
if want profile_default; then
  stage profile_default  # phase clocks of the chunk kernels as they are by default
  for C in 64 32; do
    timeout 50 python3 bench/gdn_fused_kernels.py --profile --tokens 4096 --C $C \
      --json "$OUT/gdn_profile_C${C}_default_h200.json" | grep -E "block +0, +0|rror"
  done
fi
if want gdn16k; then
  stage gdn16k  # the op at T=16384 beside fla, eager and compiled, C=64 and 32
  (cd bench && timeout 170 python3 gdn_vs_fla.py --T 16384 --impls fla chunkscan \
    --modes eager compiled --chunk-sizes 64 32 --repeats 3 --budget 150 \
    --json "$OUT/gdn_vs_fla_16k_h200.json")
fi
if want tests_pass; then
  stage tests_pass  # the state-pass kernel's CUDA tests alone
  MLX_ENABLE_TF32=0 timeout 140 python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/ops/test_gated_delta_passes.py 2>&1 | tee "$OUT/tests_h200_passes.txt" | tail -4
fi
if want gdn_eager; then
  stage gdn_eager  # the op (default chunk size) beside fla at T=16384 and 65536, eager
  (cd bench && timeout 150 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan \
    --modes eager --repeats 3 --budget 130 --json "$OUT/gdn_vs_fla_eager_h200.json")
fi
if want gdn_save; then
  stage gdn_save  # what the forward keeps (every chunk's state or each group's): time and
  # memory, with MLX's default memory limit and 1 GiB above the inputs
  (cd bench && timeout 200 python3 gdn_vs_fla.py --T 16384 65536 --impls chunkscan \
    --modes eager --save chunks groups --memory-limit-mib 0 1024 --repeats 3 --budget 180 \
    --json "$OUT/gdn_save_h200.json") | grep -E "chunkscan|rror"
fi
if want gdn_memlimit; then
  stage gdn_memlimit  # the op's peak when MLX may hold only so much above the inputs
  # (mx.set_memory_limit: MLX then waits for queued graphs and frees what they hold)
  (cd bench && timeout 150 python3 gdn_vs_fla.py --T 16384 65536 --impls chunkscan \
    --modes eager --chunk-sizes 64 --memory-limit-mib 0 1024 4096 --repeats 3 --budget 130 \
    --json "$OUT/gdn_memlimit_h200.json") | grep -E "chunkscan|rror"
fi
if want first_call; then
  stage first_call  # the op's first call (trace, kernel compilation, one run) at T=16384:
  # MLX compiling the kernels (CHUNKSCAN_CUDA_PRECOMPILE=0), chunkscan compiling them
  # into an empty cache, then reading that cache
  FC=$(mktemp -d)
  for cfg in "0 mlx" "1 cold" "1 warm"; do
    set -- $cfg
    (cd bench && CHUNKSCAN_CUDA_PRECOMPILE=$1 CHUNKSCAN_CUDA_CACHE=$FC timeout 70 python3 gdn_vs_fla.py \
      --T 16384 --impls chunkscan --modes eager --repeats 3 --json "$OUT/gdn_first_call_$2_h200.json") \
      | grep -E "chunkscan|rror"
  done
fi
if want gdn_now; then
  stage gdn_now  # the op beside fla at 16384 and 65536, eager and compiled, C = 64 and 32
  (cd bench && timeout 200 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan \
    --modes eager compiled --chunk-sizes 64 32 --repeats 3 --budget 190 \
    --json "$OUT/gdn_vs_fla_h200.json") | grep -E "fla|chunkscan|rror"
fi
if want memfloor; then
  stage memfloor  # the floor at T=65536 under a limit 1 GiB above the inputs, per group
  # budget and what the forward keeps
  (cd bench && timeout 100 python3 gdn_vs_fla.py --T 65536 --impls chunkscan --modes eager \
    --save chunks groups --group-mib 256 1024 --memory-limit-mib 1024 --repeats 3 --budget 95 \
    --json "$OUT/gdn_memfloor_65536_h200.json") | grep -E "chunkscan|rror"
fi
if want gdn_fused; then
  stage gdn_fused  # chunkscan (fused kernels) beside fla, eager and compiled
  (cd bench && timeout 270 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan \
    --modes eager compiled --chunk-sizes 64 32 --repeats 3 --budget 220 \
    --json "$OUT/gdn_vs_fla_fused_h200.json")
fi
if want gdn; then
  stage gdn_vs_fla
  (cd bench && timeout 300 python3 gdn_vs_fla.py --T 16384 65536 --modes eager compiled \
    --repeats 3 --budget 280 --json "$OUT/gdn_vs_fla_h200.json")
fi
if want pass; then
  stage state_pass
  timeout 100 python3 bench/state_pass.py --out "$OUT/state_pass_h200.json" 2>&1 | tail -20
fi
# The 4-layer Qwen3-Next-shaped model's overrides of the demo config (one file for this
# script and bench/device_run.sh's lora_8192).
CFG=$(cat "$(dirname "$0")/lora_4layer.json")
# bfloat16 weights: chunkscan.attention's CUDA kernels take bf16 (float32 runs the blocked
# ops). MLX caches compiled kernels (PTX) on disk: on a fresh machine the first
# configuration compiles every kernel of the model (minutes); the rows record how many
# were cached before (ptx_cache_files_before); the first call writes the file, --merge adds.
LORA="python3 bench/lora.py --dtype bfloat16 --repeats 2 --config $(printf %q "$CFG") --json $OUT/lora_h200_bf16.json"
if want lora8192; then
  stage lora8192  # the LoRA step at T=8192, patched against the no-recurrence stub
  eval timeout 170 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config $(printf %q "$CFG") \
    --timeout 160 --T 8192 --modes stub patched --json $OUT/lora_h200_8192.json | tail -3
fi
if want lora; then
  stage lora  # issue 10: both patches 8192 vs 32768, T=512 with and without; issue 9
  eval timeout 420 $LORA --timeout 400 --T 8192 --modes patched+attn | tail -3
  eval timeout 110 $LORA --merge --timeout 100 --T 512 --modes patched patched+attn | tail -3
  eval timeout 110 $LORA --merge --timeout 100 --T 2048 --modes patched | tail -3
  eval timeout 200 $LORA --merge --timeout 100 --T 8192 --modes stub patched | tail -3
  eval timeout 130 $LORA --merge --timeout 120 --T 32768 --modes patched+attn | tail -3
fi
if want lora_now; then
  stage lora_now  # the first step at T=2048 with chunkscan's kernel cache empty, then
  # filled; T=8192 patched against the stub; T=32768 with both patches, per save mode
  export CHUNKSCAN_CUDA_CACHE=$(mktemp -d)
  L2="python3 bench/lora.py --dtype bfloat16 --repeats 3 --config $(printf %q "$CFG")"
  eval timeout 90 $L2 --timeout 85 --T 2048 --modes stub patched --json $OUT/lora_h200_2048_cold.json | tail -2
  eval timeout 50 $L2 --timeout 45 --T 2048 --modes patched --json $OUT/lora_h200_2048_warm.json | tail -1
  eval timeout 110 $L2 --timeout 100 --T 8192 --modes stub patched --json $OUT/lora_h200_8192.json | tail -2
  for save in chunks groups; do
    eval timeout 80 $L2 --timeout 75 --T 32768 --modes patched+attn \
      --save-states $save --json $OUT/lora_h200_32768_$save.json | tail -1
  done
  unset CHUNKSCAN_CUDA_CACHE
fi
if want lora_fused; then
  stage lora_fused  # issue 9: the LoRA step with the fused kernels (patched vs stub)
  L2="python3 bench/lora.py --dtype bfloat16 --repeats 3 --config $(printf %q "$CFG")"
  eval timeout 200 $L2 --timeout 190 --T 8192 --modes stub patched \
    --json $OUT/lora_h200_fused.json | tail -3
  eval timeout 80 $L2 --merge --timeout 75 --T 8192 --modes patched --chunk-size 32 \
    --json $OUT/lora_h200_fused.json | tail -3
  eval timeout 80 $L2 --merge --timeout 75 --T 2048 --modes stub patched \
    --json $OUT/lora_h200_fused.json | tail -3
fi
if want lora_c64; then
  stage lora_c64  # the patched row at T=8192 with the default chunk size, alone
  eval timeout 75 python3 bench/lora.py --dtype bfloat16 --repeats 3 --config $(printf %q "$CFG") \
    --timeout 70 --T 8192 --modes patched --json $OUT/lora_h200_fused_c64.json | tail -2
fi
if want gdn_65536; then
  stage gdn_65536  # the fused kernels at T=65536 beside fla, eager
  (cd bench && timeout 110 python3 gdn_vs_fla.py --T 65536 --impls fla chunkscan \
    --modes eager --chunk-sizes 64 32 --repeats 3 --budget 85 \
    --json "$OUT/gdn_vs_fla_fused_65536_h200.json")
fi
if want crossover; then
  stage crossover  # where MLX's kernel (shortcut FAST_MAX_SCORES) beats the CUDA kernels
  timeout 120 python3 bench/attention.py --shape qwen3-next --T 512 1024 2048 4096 \
    --fast-max-scores 0 --impls chunkscan mlx_fast --repeats 5 --timeout 25 \
    --json "$OUT/attention_crossover_h200.json" 2>&1 | tail -8
fi
if want attention; then
  stage attention
  timeout 150 python3 bench/attention.py --shape qwen3-next --T 8192 16384 32768 65536 \
    --impls chunkscan mlx_fast --fast-max-T 16384 --repeats 3 --timeout 40 \
    --json "$OUT/attention_h200.json" 2>&1 | tail -12
  timeout 70 python3 bench/attention.py --shape qwen3-next --T 8192 16384 \
    --impls chunkscan_portable --repeats 3 --timeout 30 \
    --json "$OUT/attention_portable_h200.json" 2>&1 | tail -6
  timeout 60 python3 bench/attention.py --shape qwen3-next --T 8192 32768 --fused-forward never \
    --impls chunkscan --repeats 3 --timeout 25 \
    --json "$OUT/attention_blocked_forward_h200.json" 2>&1 | tail -6
fi
if want channel; then
  stage channel
  timeout 150 python3 bench/gated_delta.py --gate channel --T 4096 16384 --impls chunkscan \
    --repeats 2 --json "$OUT/gdn_channel_h200.json" --md "$OUT/gdn_channel_h200.md" --png ""
fi
if want channel_mlx_lm; then
  stage channel_mlx_lm  # mlx-lm's per-token loop on the GPU beside chunkscan (T <= 2048:
  # the bench's --loop-max-T, the loop's memory is ~8 MiB/token)
  timeout 120 python3 bench/gated_delta.py --gate channel --T 2048 --impls chunkscan mlx_lm \
    --repeats 1 --timeout 80 --json "$OUT/gdn_channel_mlx_lm_h200.json" \
    --md "$OUT/gdn_channel_mlx_lm_h200.md" --png ""
fi
if want kda; then
  stage kda  # fla's chunk_kda (per-channel gate) at the shapes of the channel stages;
  # PyTorch + Triton only: needs fla-core and einops, not MLX
  (cd bench && timeout 300 python3 fla_gdn.py --gate channel --T 2048 4096 16384 --repeats 5 \
    --budget 240 --json "$OUT/fla_kda_h200.json")
fi
if want phases; then
  stage phases  # issue 9: where the GDN op's time goes (one group's phases, unfused, as
  # inside mx.grad; then with the per-group compile), at the Qwen3-Next layer shape
  for fused in "" --fused; do
    timeout 150 python3 bench/gdn_phases.py --T 16384 --Hk 16 --Hv 32 --D 128 --dtype bfloat16 \
      --repeats 3 $fused --json "$OUT/gdn_phases${fused:+_fused}_h200.json"
  done
  timeout 120 python3 bench/gdn_phases.py --T 4096 --Hk 16 --Hv 32 --D 128 --dtype bfloat16 \
    --gate channel --repeats 3 --json "$OUT/gdn_phases_channel_h200.json"
fi
if want attention_kernels; then
  stage attention_kernels  # the two backward kernels timed apart, beside mx.fast's forward
  (cd bench && timeout 60 python3 attention_kernels.py --T 8192 16384 \
    --json "$OUT/attention_kernels_h200.json")
fi
if want attention_fwd; then
  stage attention_fwd  # where the memory goes: the forward alone
  timeout 60 python3 bench/attention.py --shape qwen3-next --T 8192 --phase fwd \
    --impls chunkscan mlx_fast --repeats 3 --timeout 25 \
    --json "$OUT/attention_fwd_h200.json" 2>&1 | tail -5
fi
if want groups; then
  stage groups  # the group budget and MLX's CUDA graph limits against time and memory
  for cfg in "256 default" "1024 default" "4096 default" "256 64"; do
    set -- $cfg
    if [ "$2" = default ]; then unset MLX_MAX_MB_PER_BUFFER; else export MLX_MAX_MB_PER_BUFFER=$2; fi
    CHUNKSCAN_GDN_GROUP_MIB=$1 timeout 60 python3 bench/gated_delta.py --T 16384 \
      --impls chunkscan --repeats 2 --timeout 50 --json "$OUT/gdn_groups_$1_$2.json" \
      --md "$OUT/gdn_groups_$1_$2.md" --png "" 2>&1 | grep -E "chunkscan|rror" | tail -2
  done
  unset MLX_MAX_MB_PER_BUFFER
fi
if want ptx_cache; then
  stage ptx_cache  # MLX's compiled kernels, for the next call (bench/device_setup.sh)
  PTX_DIR=/tmp/mlx/$(python3 -c 'import mlx.core as mx; print(mx.__version__)')/ptx
  [ -d "$PTX_DIR" ] && tar czf "$OUT/ptx.tgz" -C "$PTX_DIR" . && ls -la "$OUT/ptx.tgz"
fi
stage done
