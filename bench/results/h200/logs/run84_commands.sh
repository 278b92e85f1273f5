# Prepared in session 24 for the next session (not run: this session's device time was
# spent). Session 24's prepared kernel changes, reverted on main by 94e335b
# (`git revert 94e335b` re-applies them):
# - 265157a: cs_copy_rows in the shared CP_ASYNC header (csg::copy_tile's copies through
#   it); cs_ldsm4_tf32<ROUND> for tc_run and the state pass's phase 1;
# - ea257b8: load_tile / TileLoad hand a piece's values on from its (first column / 32)-th,
#   so that the warp's stores into shared memory meet fewer bank conflicts.
# Both bitwise the values before in the emulator; NVRTC compile check clean.
# `bash <this> a <commit> <main's commit>` (base/ = `git archive <main's commit> src`): the
# CUDA tests of the three kernel test files (kernel_checks' cuda_tests: up to 420 s, so
# this part has no fla stage), Nsight Compute new and base, the phase clocks. Outputs in
# $OUT/run84a.tgz.
source bench/device_run.sh 84 "$@"  # st, $BASE, $S, pack, kernel_checks
kernel_checks
st done
