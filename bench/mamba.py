"""Mamba's layer (mlx-lm's ``MambaBlock``: projections, convolution, the selective
scan) fwd+bwd time and backward peak memory per token against T: mlx-lm's own per-token
loop beside the same layer under ``chunkscan.mlx_lm.patch()``, which runs its scan
through :func:`chunkscan.selective_scan`.

Implementations (``--impls``), each configuration in a fresh process
(:func:`chunkscan.commands.measure.run_isolated`):

- ``mlx_lm``: ``mlx_lm.models.mamba.MambaBlock`` as it is (the training path of mamba and
  falcon_mamba: ``ssm_step`` per token under MLX's autograd);
- ``chunkscan``: the same layer inside ``chunkscan.mlx_lm.patch()`` (``--chunk-size``:
  the op's chunk instead of its default).

Shape (``--hidden``, ``--channels``, ``--state``, ``--dt-rank``; default Falcon-Mamba 7B's
layer: hidden 4096, 8192 channels, a state of 16, dt rank 256, its RMS norms of delta, B
and C), B = 1, ``--dtype`` weights and inputs. The loss is ``sum(layer(x) * w)``; the
gradient for ``x`` alone (the weights constant, as LoRA leaves them: what grows with T
is the activations the backward keeps, where the weights' own gradients, about 400 MiB
at this shape, would hide it at small T). Memory: ``mx.get_peak_memory()`` above the
active memory before the call, after one warm-up call. Time: median of ``--repeats``
warm calls; the speedup is against ``mlx_lm`` at the same T in the same run.

    python bench/mamba.py --T 256 512 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMPLS = ("mlx_lm", "chunkscan")


def measure(
    impl: str, T: int, dtype: str = "bfloat16", repeats: int = 2, hidden: int = 4096,
    channels: int = 8192, state: int = 16, dt_rank: int = 256, chunk_size: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One configuration (run in its own process by :func:`main`)."""
    import mlx.core as mx
    from _common import grad_call, patch_chunkscan, routed_row
    from mlx_lm.models import mamba

    from chunkscan.ops.selective_scan import chunk as s6

    args = mamba.ModelArgs(
        model_type="falcon_mamba", vocab_size=8, hidden_size=hidden, intermediate_size=channels,
        state_size=state, num_hidden_layers=1, conv_kernel=4, use_bias=False,
        use_conv_bias=True, time_step_rank=dt_rank,
    )  # fmt: skip
    mx.random.seed(0)
    layer = mamba.MambaBlock(args)
    layer.set_dtype(getattr(mx, dtype))
    x = mx.random.normal((1, T, hidden), key=mx.random.key(1)).astype(getattr(mx, dtype))
    w = mx.random.normal((1, T, hidden), key=mx.random.key(2))
    mx.eval(layer.parameters(), x, w)
    chunk = patch_chunkscan(impl, s6, chunk_size)

    def loss(x):
        z, _ = layer._process_sequence(x, None, None)
        return mx.sum(z.astype(mx.float32) * w)

    call = grad_call(loss, x)

    fields = {"dtype": dtype, "hidden": hidden, "channels": channels, "state": state,
              "dt_rank": dt_rank, "chunk_size": chunk}  # fmt: skip
    return routed_row(impl, T, call, "chunkscan.selective_scan", repeats, fields)


def build_parser() -> argparse.ArgumentParser:
    from _common import add_chunk_size_option, add_side_by_side_options, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_side_by_side_options(p, IMPLS, [256, 512, 1024], "mamba")
    p.add_argument("--hidden", type=positive_int, default=4096)
    p.add_argument("--channels", type=positive_int, default=8192)
    p.add_argument("--state", type=positive_int, default=16)
    p.add_argument("--dt-rank", type=positive_int, default=256)
    add_chunk_size_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    parser = build_parser()
    args = parser.parse_args(argv)
    from _common import exit_status, run_side_by_side

    config = {"hidden": args.hidden, "channels": args.channels, "state": args.state,
              "dt_rank": args.dt_rank, "chunk_size": args.chunk_size}  # fmt: skip
    title = (f"Mamba layer (B=1, hidden {args.hidden}, {args.channels} channels, state "
             f"{args.state}, dt rank {args.dt_rank}, {args.dtype}), fwd+bwd")  # fmt: skip
    rows = run_side_by_side(
        parser, args, "bench.mamba:measure", config, title, "mlx_lm", __file__, argv
    )
    return exit_status(rows, "mamba.py")


if __name__ == "__main__":
    sys.exit(main())
