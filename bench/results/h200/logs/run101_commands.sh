# Run 101 (prepared in session 35; run in session 36 on an H100, outputs and log under
# bench/results/h100/, logs/run101_c319df7.txt),
# after run 100 (5c49b15). Session 35 changed the state-pass kernels without a GPU
# (25ced99: a float32 initial state given as a view at an odd offset is read a float at a
# time where it is not aligned for the kernel's vector or wmma loads, which had faulted);
# emulated and NVRTC-compiled only (bench/results/cpu/cuda_compile_check_state_pass_25ced99.txt).
# 718f99f did the same for the attention kernels' 16-byte loads of q, k, v, the
# cotangent and o (one element at a time, out of line, where misaligned).
# This run:
#   the CUDA tests of the attention kernels (test_cuda_kernels_read_inputs_at_an_odd_offset
#   new) and their two backward kernels' times at T = 16384, new, base, new (is the
#   out-of-line fallback free? ptxas: 16 bytes more spill loads in dkdv at D = 256);
#   the CUDA tests of the state passes and the fused op (the new
#   test_cuda_initial_state_at_an_odd_offset among them: values and gradients equal to
#   the aligned call's with the wmma, mma and FMA passes), kernel_checks' Nsight Compute
#   kernel times at T = 16384 against base/ (c652525: is the uniform alignment branch
#   free?) and the phase clocks;
#   one side-by-side sample at T = 16384, ten repeats, beside fla.
# Three calls after the set-up call (each under the 600 s limit): `bash <this> <part>
# <commit> c652525` with part a (the CUDA tests), b (the attention kernels' times,
# Nsight Compute against base/, the phase clocks), c (the sample); outputs in
# $OUT/run101<part>.tgz (base/ = `git archive c652525 src`, carried).
source bench/device_run.sh 101 "$@"  # st, $S, pack, kernel stages, samples_16384
case "$RUN_PART" in
a)
  st attention_tests  # (cuda_tests writes tests_h200_cuda.txt, for the GDN files below)
  MLX_ENABLE_TF32=0 timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rs \
    tests/ops/test_attention_cuda.py -k "cuda and not emulated" 2>&1 \
    | tee $S/tests_h200_attention.txt | grep -E "passed|failed|^FAILED|Error" | tail -6
  pack
  st tests
  cuda_tests
  pack
  ;;
b)
  st attention_kernels
  mkdir -p base/bench && cp bench/attention_kernels.py bench/_common.py base/bench/  # its src/
  for tree in . base .; do
    tag=$( [ $tree = . ] && echo new || echo base )
    (cd $tree && timeout 100 python3 bench/attention_kernels.py --T 16384 \
      --json $S/attention_kernels_${tag}_$RANDOM.json 2>&1 | tail -2)
  done
  pack
  kernel_timings
  ;;
c)
  cd bench
  samples_16384 1
  ;;
esac
st done
