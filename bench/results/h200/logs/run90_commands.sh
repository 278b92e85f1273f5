# Run 90 (session 26). Run 89 found where the compiled call's extra GPU time went: the
# benchmark's loss, not the op. Compiled by MLX, the gradient of sum(o * w) (w times the
# broadcast scalar cotangent, cast to bf16) became one fused kernel on MLX's strided path:
# 5.92 ms at T = 65536, against 0.28 ms for the eager product. gdn_vs_fla.py now takes
# --harness: "cotangents" (the gradients given w and w_s as the outputs' cotangents:
# mx.vjp / torch.autograd.grad(grad_outputs=...), the op alone) and "loss" (the harness
# before). Both side by side with fla, the same code as runs 88-89 for the op.
# `bash <this> a <commit> <commit>`. Outputs in $OUT/run90a.tgz.
source bench/device_run.sh 90 "$@"  # st, $S, pack
cd bench
st fla
timeout 520 python3 gdn_vs_fla.py --T 16384 65536 --impls fla chunkscan --modes eager compiled \
  --chunk-sizes 64 --repeats 3 --harness cotangents loss --json $S/gdn_vs_fla_h200.json \
  | grep --line-buffered -E "fla|chunkscan|rror"
pack
st done
