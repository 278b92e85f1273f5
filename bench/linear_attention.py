"""Lightning attention (linear attention with a constant decay per head) fwd+bwd time
and backward peak memory per token against T: ``chunkscan.linear_attention`` beside
mlx-lm's two ``recurrent_gla`` (the Bailing linear models' layer).

Implementations (``--impls``), each configuration in a fresh process
(:func:`chunkscan.commands.measure.run_isolated`):

- ``chunkscan``: :func:`chunkscan.linear_attention` (chunk-parallel groups, backward by hand);
- ``mlx_lm_loop``: ``mlx_lm.models.bailing_moe_linear.recurrent_gla``, a per-token loop
  (its training path; what ``chunkscan.mlx_lm.patch()`` replaces);
- ``mlx_lm_chunked``: ``mlx_lm.models.bailing_hybrid.recurrent_gla``, chunks of 128 in a
  Python loop under MLX's autograd.

Shape: B=1, 16 heads of 128 (Ring-mini-linear-2.0's linear layers), the decays of
mlx-lm's ``_get_slopes`` for 16 heads, ``--dtype`` inputs. The loss is ``sum(o * w) +
sum(final_state * w_s)``; gradients for q, k, v and the initial state. Memory:
``mx.get_peak_memory()`` above the active memory before the call, after one warm-up
call. Time: median of ``--repeats`` warm calls. Ratios against ``mlx_lm_loop`` at the
same T in the same run.

    python bench/linear_attention.py --T 512 1024 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out"  # default outputs (git-ignored); committed runs name their paths
IMPLS = ("chunkscan", "mlx_lm_loop", "mlx_lm_chunked")
KiB = 1024.0


def slopes(H: int) -> list[float]:
    """mlx-lm's Bailing decays for ``H`` heads (a power of two), ``-2 ** (-8 (i + 1) / H)``
    (its ``_get_slopes``; the first layer's, less their factor of ``1 + 1e-5``)."""
    return [-(2 ** (-8 * (i + 1) / H)) for i in range(H)]


def measure(
    impl: str, T: int, dtype: str = "bfloat16", repeats: int = 2,
    chunk_size: int | None = None, B: int = 1, H: int = 16, D: int = 128,
) -> dict[str, Any]:  # fmt: skip
    """One configuration (run in its own process by :func:`main`); ``chunk_size``:
    chunkscan's (``None``: the op's default on the device)."""
    import mlx.core as mx

    import chunkscan
    from chunkscan.commands.measure import median_seconds, peak_above_active
    from chunkscan.ops.linear_attention.chunk import default_chunk_size

    chunk_size = chunk_size or default_chunk_size()

    dt = getattr(mx, dtype)
    keys = mx.random.split(mx.random.key(0), 6)
    q, k, v = (mx.random.normal((B, T, H, D), key=kk).astype(dt) for kk in keys[:3])
    h0 = 0.1 * mx.random.normal((B, H, D, D), key=keys[3])
    w = mx.random.normal((B, T, H, D), key=keys[4])
    w_s = mx.random.normal((B, H, D, D), key=keys[5])
    g = mx.array(slopes(H))
    scale = D**-0.5
    mx.eval(q, k, v, h0, w, w_s, g)

    if impl == "chunkscan":

        def op(q, k, v, h0):
            gates = mx.broadcast_to(g, (B, T, H))
            return chunkscan.linear_attention(
                q, k, v, gates, scale=scale, initial_state=h0, chunk_size=chunk_size
            )

    else:
        import importlib

        family = "bailing_moe_linear" if impl == "mlx_lm_loop" else "bailing_hybrid"
        gla = importlib.import_module(f"mlx_lm.models.{family}").recurrent_gla

        def op(q, k, v, h0):  # heads first, the state [Dk, Dv]
            qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
            h = h0.swapaxes(-1, -2)
            if family == "bailing_hybrid":
                y, s = gla(qh, kh, vh, g, scale=scale, h=h)
            else:
                y, s = gla(qh, kh, vh, g, scale, h=h)
            return y.transpose(0, 2, 1, 3), s.swapaxes(-1, -2)

    def loss(q, k, v, h0):
        o, s = op(q, k, v, h0)
        return mx.sum(o.astype(mx.float32) * w) + mx.sum(s.astype(mx.float32) * w_s)

    grad = mx.value_and_grad(loss, argnums=(0, 1, 2, 3))

    def call():
        return grad(q, k, v, h0)

    mx.eval(call())  # warm-up
    _, peak = peak_above_active(call)
    seconds = median_seconds(call, repeats=repeats, warmup=0)
    # the chunk the op ran at: T where T is shorter (one short chunk); mlx-lm's rows
    # take none of chunkscan's (they recorded the default; found by probing, session 48)
    ours = impl == "chunkscan"
    return {"impl": impl, "T": T, "dtype": dtype, "chunk_size": chunk_size if ours else None,
            "chunk_run": min(chunk_size, T) if ours else None,
            "seconds": seconds, "peak_bytes": peak, "kib_per_token": peak / KiB / T,
            "device": str(mx.default_device())}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from _common import Once, positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=positive_int, nargs="+", action=Once, default=[512, 1024, 2048])
    p.add_argument("--impls", nargs="+", action=Once, default=list(IMPLS), choices=IMPLS)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument("--chunk-size", type=positive_int, default=None,
                   help="chunkscan's chunk (default: the op's on the device: 64 on a CPU, "
                   "256 on a GPU)")  # fmt: skip
    p.add_argument("--loop-max-T", type=positive_int, default=2048,
                   help="largest T for mlx_lm_loop (a state per token in memory)")  # fmt: skip
    p.add_argument("--timeout", type=positive_float, default=1800.0,
                   help="seconds per configuration")  # fmt: skip
    p.add_argument("--json", default=str(OUT / "linear_attention.json"))
    p.add_argument("--md", default=str(OUT / "linear_attention.md"))
    return p


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| impl | T | fwd+bwd (s) | peak (KiB/token) | speedup vs mlx_lm_loop |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['T']} | {r['error']} | | |")
            continue
        sp = f"{r['speedup_vs_loop']:.2f}x" if "speedup_vs_loop" in r else ""
        lines.append(f"| {r['impl']} | {r['T']} | {r['seconds']:.3f} | "
                     f"{r['kib_per_token']:.1f} | {sp} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    parser = build_parser()
    args = parser.parse_args(argv)
    args.T = list(dict.fromkeys(args.T))  # each T once
    from _common import check_outputs, child_env, exit_status, meta, write_json

    check_outputs(parser, {"--json": args.json, "--md": args.md}, optional=("--json", "--md"))
    from chunkscan.commands.measure import run_isolated

    rows = []
    for T in args.T:
        for impl in args.impls:
            cfg = {"impl": impl, "T": T, "dtype": args.dtype, "repeats": args.repeats,
                   "chunk_size": args.chunk_size}  # fmt: skip
            if impl == "mlx_lm_loop" and T > args.loop_max_T:
                row = dict(cfg, error=f"skipped (T > --loop-max-T {args.loop_max_T})")
            else:
                row = run_isolated("bench.linear_attention:measure", cfg, timeout=args.timeout,
                                   env=child_env())  # fmt: skip
                row.update({k: v for k, v in cfg.items() if k not in row})
            rows.append(row)
            print(row.get("error") or f"{impl:>15} T={T:>6}: {row['seconds']:8.3f} s "
                  f"{row['kib_per_token']:9.1f} KiB/token", flush=True)  # fmt: skip
    loop = {r["T"]: r for r in rows if r["impl"] == "mlx_lm_loop" and "error" not in r}
    for r in rows:
        if r["T"] in loop and "error" not in r:
            r["speedup_vs_loop"] = loop[r["T"]]["seconds"] / r["seconds"]
    title = f"Lightning attention (B=1, H=16, D=128, {args.dtype}), fwd+bwd"
    md = f"{title}\n\n{table(rows)}\n"
    print()
    print(md)
    info = meta(__file__, argv)
    if args.json:
        write_json(args.json, info, rows)
    if args.md:
        pathlib.Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.md).write_text(md)
    return exit_status(rows, "linear_attention.py")


if __name__ == "__main__":
    sys.exit(main())
