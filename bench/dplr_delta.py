"""``chunkscan.dplr_delta_rule`` alone (RWKV-7's recurrence, no layer around it) fwd+bwd
time and backward peak memory per token against T, beside mlx-lm's per-token loop of the
same recurrence (``mlx_lm.models.rwkv7._wkv7_step_ops``, what its ``_wkv7`` runs on a CPU
or CUDA).

Implementations (``--impls``), each configuration in a fresh process
(:func:`chunkscan.commands.measure.run_isolated`):

- ``mlx_lm``: the loop of ``_wkv7_step_ops`` over the tokens, its outputs stacked, under
  MLX's autograd;
- ``chunkscan``: ``dplr_delta_rule(r, k, v, a, b, log w)`` (``--chunk-size``: the op's
  chunk instead of its default).

Shape (``--heads``, ``--head-dim``; default RWKV-7 1.5B's: 32 heads of 64), B = 1,
``--dtype`` inputs, RWKV-7's inputs (``a = -kk``, ``b = kk * iclr``, ``w`` in [0.545,
1]; ``k`` a normal draw times 0.5, the others' draws unscaled). The loss is ``sum(o *
w)``; the gradients of all six inputs. Memory: ``mx.get_peak_memory()`` above the active
memory before the call, after one warm-up call. Time: median of ``--repeats`` warm
calls; the speedup is against ``mlx_lm`` at the same T in the same run. ``--compiled``:
the fwd+bwd under ``mx.compile``.

    python bench/dplr_delta.py --T 512 1024 --dtype float32 --repeats 3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMPLS = ("mlx_lm", "chunkscan")


def measure(
    impl: str, T: int, dtype: str = "float32", repeats: int = 2, heads: int = 32,
    head_dim: int = 64, chunk_size: int | None = None, compiled: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One configuration (run in its own process by :func:`main`)."""
    import mlx.core as mx
    from _common import routed_row
    from mlx_lm.models.rwkv7 import _wkv7_step_ops

    from chunkscan import dplr_delta_rule
    from chunkscan.ops.dplr_delta import chunk as dplr

    shape = (1, T, heads, head_dim)
    keys = mx.random.split(mx.random.key(1), 7)
    r, k, v, kk, lr, d, w_out = (mx.random.normal(shape, key=key) for key in keys)
    kk = kk / mx.linalg.norm(kk, axis=-1, keepdims=True)
    w = mx.exp(-0.606531 * mx.sigmoid(d))
    inputs = tuple(
        x.astype(getattr(mx, dtype)) for x in (r, w, 0.5 * k, v, -kk, kk * mx.sigmoid(lr))
    )
    mx.eval(inputs, w_out)
    chunk = (chunk_size or dplr.default_chunk_size()) if impl == "chunkscan" else None

    def stock(r, w, k, v, a, b):
        state = mx.zeros((1, heads, head_dim, head_dim), dtype=r.dtype)
        ys = []
        for t in range(T):
            y, state = _wkv7_step_ops(r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t], state)
            ys.append(y)
        return mx.stack(ys, axis=1)[..., 0]

    def ours(r, w, k, v, a, b):
        g = mx.log(w.astype(mx.float32))
        return dplr_delta_rule(r, k, v, a, b, g, chunk_size=chunk)[0]

    fn = stock if impl == "mlx_lm" else ours
    grad = mx.grad(lambda *x: mx.sum(fn(*x).astype(mx.float32) * w_out), argnums=tuple(range(6)))
    if compiled:
        grad = mx.compile(grad)

    def call():
        return grad(*inputs)

    fields = {"dtype": dtype, "heads": heads, "head_dim": head_dim, "chunk_size": chunk,
              "compiled": compiled}  # fmt: skip
    return routed_row(impl, T, call, None, repeats, fields)


def build_parser() -> argparse.ArgumentParser:
    from _common import add_chunk_size_option, add_side_by_side_options, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_side_by_side_options(p, IMPLS, [512, 1024], "dplr_delta")
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--head-dim", type=positive_int, default=64)
    add_chunk_size_option(p)
    p.add_argument("--compiled", action="store_true",
                   help="the fwd+bwd under mx.compile (as a compiled training step)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    parser = build_parser()
    args = parser.parse_args(argv)
    from _common import exit_status, run_side_by_side

    config = {"heads": args.heads, "head_dim": args.head_dim, "chunk_size": args.chunk_size,
              "compiled": args.compiled}  # fmt: skip
    title = (f"dplr_delta_rule alone (RWKV-7's recurrence; B=1, {args.heads} heads of "
             f"{args.head_dim}, {args.dtype}), fwd+bwd"
             f"{' compiled' if args.compiled else ''}, all six gradients")  # fmt: skip
    rows = run_side_by_side(
        parser, args, "bench.dplr_delta:measure", config, title, "mlx_lm", __file__, argv
    )
    return exit_status(rows, "dplr_delta.py")


if __name__ == "__main__":
    sys.exit(main())
