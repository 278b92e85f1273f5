# Session 23, prepared for the next session's first call (not run: this session's device
# time was spent): branch wip/state-grads-early-piece against main.
# - state_grads issues pass 1's first piece (S, dS, w, kt) with p's copy at its start, so
#   that those copies wait with the first loads, not after the product p^T d_o;
# - prepare (TF32 builds) keeps L and A at row stride C + 4 and reads A's rows by
#   ldmatrix for w and u, without the copy of A at that stride and its barrier.
# Both bitwise the values before in the emulator. `bash <this> a <commit> <main's commit>`
# (base/ = `git archive <main's commit> src`): the CUDA tests, Nsight Compute new and
# base, the phase clocks (kernel_checks); then fla side by side. Outputs in
# $OUT/run78a.tgz.
source bench/device_run.sh 78 "$@"  # st, $BASE, $S, pack, kernel_checks, ...
kernel_checks
cd bench
st fla
fla_side_by_side
pack
st done
