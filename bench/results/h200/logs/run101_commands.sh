# Run 101 (prepared in session 35, not run yet: no device machine was lent that session),
# after run 100 (5c49b15). Session 35 changed the state-pass kernels without a GPU
# (25ced99: a float32 initial state given as a view at an odd offset is read a float at a
# time where it is not aligned for the kernel's vector or wmma loads, which had faulted);
# emulated and NVRTC-compiled only (bench/results/cpu/cuda_compile_check_state_pass_25ced99.txt).
# This run:
#   the CUDA tests of the state passes and the fused op (the new
#   test_cuda_initial_state_at_an_odd_offset among them: values and gradients equal to
#   the aligned call's with the wmma, mma and FMA passes), kernel_checks' Nsight Compute
#   kernel times at T = 16384 against base/ (c652525: is the uniform alignment branch
#   free?) and the phase clocks;
#   one side-by-side sample at T = 16384, ten repeats, beside fla.
# One call after the set-up call: `bash <this> a <commit> c652525`; outputs in
# $OUT/run101a.tgz (base/ = `git archive c652525 src`, carried).
source bench/device_run.sh 101 "$@"  # st, $S, pack, kernel_checks, samples_16384
kernel_checks
cd bench
samples_16384 1
st done
