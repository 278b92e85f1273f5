"""Mamba2's SSD layer (mlx-lm's ``ssm_attn``) fwd+bwd time and backward peak memory per
token against T: mlx-lm's own form beside the same call under
``chunkscan.mlx_lm.patch()``, which routes it to :func:`chunkscan.linear_attention`.

Implementations (``--impls``), each configuration in a fresh process
(:func:`chunkscan.commands.measure.run_isolated`):

- ``mlx_lm``: ``mlx_lm.models.ssm.ssm_attn`` (chunks of 256 tokens in a Python loop under
  MLX's autograd; the training path of mamba2, nemotron_h, falcon_h1, granitemoehybrid
  and plamo2);
- ``chunkscan``: the same function called inside ``chunkscan.mlx_lm.patch()``.

Shape (``--heads``, ``--head-dim``, ``--state``, ``--groups``; default Nemotron-H 8B's
Mamba2 layer: 128 heads of 64, a state of 128 per head, 8 groups), B = 1, ``--dtype``
inputs ``x``, ``B``, ``C``, ``dt`` and float32 ``A_log``, ``D``, ``dt_bias`` and initial
state. The loss is ``sum(y * w) + sum(final_state * w_s)``; gradients for all eight.
Memory: ``mx.get_peak_memory()`` above the active memory before the call, after one
warm-up call. Time: median of ``--repeats`` warm calls; the speedup is against
``mlx_lm`` at the same T in the same run.

    python bench/mamba2.py --T 512 1024 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMPLS = ("mlx_lm", "chunkscan")


def measure(
    impl: str, T: int, dtype: str = "bfloat16", repeats: int = 2,
    heads: int = 128, head_dim: int = 64, state: int = 128, groups: int = 8,
) -> dict[str, Any]:  # fmt: skip
    """One configuration (run in its own process by :func:`main`)."""
    import mlx.core as mx
    from _common import grad_call, routed_row
    from mlx_lm.models import ssm

    import chunkscan.mlx_lm

    dt_ = getattr(mx, dtype)
    keys = mx.random.split(mx.random.key(0), 10)
    x = mx.random.normal((1, T, heads, head_dim), key=keys[0]).astype(dt_)
    B, C = (0.3 * mx.random.normal((1, T, groups, state), key=kk).astype(dt_) for kk in keys[1:3])
    dt = mx.random.normal((1, T, heads), key=keys[3]).astype(dt_)
    A_log = mx.random.uniform(0.0, 2.7, (heads,), key=keys[4])  # A in [-15, -1], as trained
    D, dt_bias = (mx.random.normal((heads,), key=kk) for kk in keys[5:7])
    s0 = 0.1 * mx.random.normal((1, heads, head_dim, state), key=keys[7])
    w = mx.random.normal(x.shape, key=keys[8])
    w_s = mx.random.normal(s0.shape, key=keys[9])
    inputs = (x, A_log, B, C, D, dt, dt_bias, s0)
    mx.eval(inputs, w, w_s)
    if impl == "chunkscan":
        chunkscan.mlx_lm.patch()  # for the rest of this process

    def loss(*args):
        y, s = ssm.ssm_attn(*args)
        return mx.sum(y.astype(mx.float32) * w) + mx.sum(s.astype(mx.float32) * w_s)

    call = grad_call(loss, *inputs)

    fields = {"dtype": dtype, "heads": heads, "head_dim": head_dim, "state": state,
              "groups": groups}  # fmt: skip
    return routed_row(impl, T, call, "chunkscan.linear_attention (Mamba2)", repeats, fields)


def build_parser() -> argparse.ArgumentParser:
    from _common import add_side_by_side_options, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_side_by_side_options(p, IMPLS, [512, 1024, 2048], "mamba2")
    p.add_argument("--heads", type=positive_int, default=128)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--state", type=positive_int, default=128)
    p.add_argument("--groups", type=positive_int, default=8)
    return p


def main(argv: list[str] | None = None) -> int:
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.heads % args.groups:
        parser.error(f"--heads {args.heads} is not a multiple of --groups {args.groups}")
    from _common import exit_status, run_side_by_side

    shape = {"heads": args.heads, "head_dim": args.head_dim, "state": args.state,
             "groups": args.groups}  # fmt: skip
    title = (f"Mamba2 SSD (B=1, {args.heads} heads of {args.head_dim}, state {args.state}, "
             f"{args.groups} groups, {args.dtype}), fwd+bwd")  # fmt: skip
    rows = run_side_by_side(
        parser, args, "bench.mamba2:measure", shape, title, "mlx_lm", __file__, argv
    )
    return exit_status(rows, "mamba2.py")


if __name__ == "__main__":
    sys.exit(main())
