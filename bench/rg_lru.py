"""RecurrentGemma's recurrent block (mlx-lm's ``RecurrentBlock``: projections, the
convolution, the RG-LRU and its scan) fwd+bwd time and backward peak memory per token
against T: mlx-lm's own ``rnn_scan`` (a loop of slice updates of a ``[B, T, D]`` array)
beside the same block under ``chunkscan.mlx_lm.patch()``, which runs the scan through
:func:`chunkscan.diagonal_recurrence`.

Implementations (``--impls``), each configuration in a fresh process
(:func:`chunkscan.commands.measure.run_isolated`):

- ``mlx_lm``: ``mlx_lm.models.recurrent_gemma.RecurrentBlock`` as it is;
- ``chunkscan``: the same block inside ``chunkscan.mlx_lm.patch()`` (``--chunk-size``:
  the op's chunk instead of its default).

Shape (``--width``, ``--heads``; default RecurrentGemma 2B's block: width 2560, 10
heads), B = 1, ``--dtype`` weights and inputs, the parameters mlx-lm initializes to zero
(the RG-LRU's gates and decay, the convolution) made random. The loss is
``sum(block(x) * w)``; the gradient for ``x`` alone (the weights constant, as LoRA leaves
them). Memory: ``mx.get_peak_memory()`` above the active memory before the call, after
one warm-up call. Time: median of ``--repeats`` warm calls; the speedup is against
``mlx_lm`` at the same T in the same run.

    python bench/rg_lru.py --T 256 512 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMPLS = ("mlx_lm", "chunkscan")


def measure(
    impl: str, T: int, dtype: str = "bfloat16", repeats: int = 2, width: int = 2560,
    heads: int = 10, chunk_size: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One configuration (run in its own process by :func:`main`)."""
    import mlx.core as mx
    from _common import grad_call, patch_chunkscan, randomize_zeros, routed_row
    from mlx_lm.models import recurrent_gemma

    from chunkscan.ops.diagonal import chunk as diagonal

    mx.random.seed(0)
    block = recurrent_gemma.RecurrentBlock(width=width, num_heads=heads)
    randomize_zeros(block, 0.3)
    block.set_dtype(getattr(mx, dtype))
    x = mx.random.normal((1, T, width), key=mx.random.key(1)).astype(getattr(mx, dtype))
    w = mx.random.normal((1, T, width), key=mx.random.key(2))
    mx.eval(block.parameters(), x, w)
    chunk = patch_chunkscan(impl, diagonal, chunk_size)

    def loss(x):
        return mx.sum(block(x).astype(mx.float32) * w)

    call = grad_call(loss, x)

    fields = {"dtype": dtype, "width": width, "heads": heads, "chunk_size": chunk}
    return routed_row(impl, T, call, "chunkscan.diagonal_recurrence", repeats, fields)


def build_parser() -> argparse.ArgumentParser:
    from _common import add_chunk_size_option, add_side_by_side_options, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_side_by_side_options(p, IMPLS, [256, 512, 1024], "rg_lru")
    p.add_argument("--width", type=positive_int, default=2560)
    p.add_argument("--heads", type=positive_int, default=10)
    add_chunk_size_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    from _common import exit_status, run_side_by_side

    config = {"width": args.width, "heads": args.heads, "chunk_size": args.chunk_size}
    title = (f"RecurrentGemma recurrent block (B=1, width {args.width}, {args.heads} heads, "
             f"{args.dtype}), fwd+bwd")  # fmt: skip
    rows = run_side_by_side(
        parser, args, "bench.rg_lru:measure", config, title, "mlx_lm", __file__, argv
    )
    return exit_status(rows, "rg_lru.py")


if __name__ == "__main__":
    sys.exit(main())
