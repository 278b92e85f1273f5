"""RWKV-7's time-mixing layer (mlx-lm's ``Rwkv7TimeMixing``: token shift, projections,
the generalized delta rule, its norm and gate) fwd+bwd time and backward peak memory per
token against T: mlx-lm's own per-token loop beside the same layer under
``chunkscan.mlx_lm.patch()``, which runs its recurrence through
:func:`chunkscan.dplr_delta_rule`.

Implementations (``--impls``), each configuration in a fresh process
(:func:`chunkscan.commands.measure.run_isolated`):

- ``mlx_lm``: ``mlx_lm.models.rwkv7.Rwkv7TimeMixing`` as it is (on a CPU or CUDA its
  training path: ``_wkv7_step_ops`` per token under MLX's autograd; on an Apple GPU a
  Metal kernel with no gradient, so this impl fails there);
- ``chunkscan``: the same layer inside ``chunkscan.mlx_lm.patch()`` (``--chunk-size``:
  the op's chunk instead of its default).

Shape (``--hidden``, ``--head-dim``; default RWKV-7 1.5B's layer: hidden 2048, 32 heads
of 64, low ranks 96 / 64 / 256 / 96 for a / v / gate / decay), B = 1, ``--dtype``
weights and inputs, the parameters rwkv7 initializes to zero made random (with ``k_k =
0`` the low-rank term vanishes). The loss is ``sum(layer(x) * w)``; the gradient for
``x`` alone (the weights constant, as LoRA leaves them: what grows with T is what the
backward keeps). Memory: ``mx.get_peak_memory()`` above the active memory before the
call, after one warm-up call. Time: median of ``--repeats`` warm calls; the speedup is
against ``mlx_lm`` at the same T in the same run.

    python bench/rwkv7.py --T 256 512 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMPLS = ("mlx_lm", "chunkscan")


def measure(
    impl: str, T: int, dtype: str = "bfloat16", repeats: int = 2, hidden: int = 2048,
    head_dim: int = 64, chunk_size: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One configuration (run in its own process by :func:`main`)."""
    import mlx.core as mx
    from _common import grad_call, patch_chunkscan, randomize_zeros, routed_row
    from mlx_lm.models import rwkv7

    from chunkscan.ops.dplr_delta import chunk as dplr

    args = rwkv7.ModelArgs(
        model_type="rwkv7", vocab_size=8, hidden_size=hidden, intermediate_size=4 * hidden,
        norm_eps=1e-5, head_dim=head_dim, num_hidden_layers=1, a_low_rank_dim=96,
        v_low_rank_dim=64, gate_low_rank_dim=256, decay_low_rank_dim=96,
    )  # fmt: skip
    mx.random.seed(0)
    layer = rwkv7.Rwkv7TimeMixing(args, layer_idx=0)
    randomize_zeros(layer, 0.5)
    layer.set_dtype(getattr(mx, dtype))
    x = mx.random.normal((1, T, hidden), key=mx.random.key(1)).astype(getattr(mx, dtype))
    w = mx.random.normal((1, T, hidden), key=mx.random.key(2))
    mx.eval(layer.parameters(), x, w)
    chunk = patch_chunkscan(impl, dplr, chunk_size)

    def loss(x):
        z, _ = layer(x, None, None)
        return mx.sum(z.astype(mx.float32) * w)

    call = grad_call(loss, x)

    fields = {"dtype": dtype, "hidden": hidden, "head_dim": head_dim, "chunk_size": chunk}
    return routed_row(impl, T, call, "chunkscan.dplr_delta_rule", repeats, fields)


def build_parser() -> argparse.ArgumentParser:
    from _common import add_chunk_size_option, add_side_by_side_options, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_side_by_side_options(p, IMPLS, [256, 512, 1024], "rwkv7")
    p.add_argument("--hidden", type=positive_int, default=2048)
    p.add_argument("--head-dim", type=positive_int, default=64)
    add_chunk_size_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    parser = build_parser()
    args = parser.parse_args(argv)
    from _common import exit_status, run_side_by_side

    config = {"hidden": args.hidden, "head_dim": args.head_dim, "chunk_size": args.chunk_size}
    title = (f"RWKV-7 time mixing (B=1, hidden {args.hidden}, heads of {args.head_dim}, "
             f"{args.dtype}), fwd+bwd")  # fmt: skip
    rows = run_side_by_side(
        parser, args, "bench.rwkv7:measure", config, title, "mlx_lm", __file__, argv
    )
    return exit_status(rows, "rwkv7.py")


if __name__ == "__main__":
    sys.exit(main())
