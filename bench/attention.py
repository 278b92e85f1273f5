"""Attention fwd+bwd time and peak memory per token: chunkscan against mx.fast.

Implementations (``--impls``), each configuration in a fresh process
(:func:`chunkscan.commands.measure.run_isolated`):

- ``chunkscan``: :func:`chunkscan.attention` (on CUDA its fused backward kernels where
  they apply, else query blocks with an ordered backward);
- ``chunkscan_portable``: the same with ``kernels=False`` (the blocked MLX ops);
- ``mlx_fast``: ``mx.fast.scaled_dot_product_attention`` (MLX's fused forward; its
  backward is MLX's unfused VJP, which keeps the ``T x S`` scores);
- ``chunkscan_unordered``: chunkscan with the ordering edges of
  :mod:`chunkscan._ordering` switched off (the negative control of the memory test).

The loss is ``sum(o)`` (float32); gradients for q, k and v. Memory:
``mx.get_peak_memory()`` above the active memory before the call (inputs excluded;
forward, backward and the gradients included), after one warm-up call, per token of
the whole batch (``kib_per_token``: the peak over ``tokens`` = B x T). Time: median
of ``--repeats`` warm calls, and the ratio to ``mlx_fast`` at the same T in the same
run. Output (default ``bench-out/attention.json`` in the repository root, wherever it is
run from; outside ``bench/results``): a JSON list of rows ``{"impl", "T", "ms",
"kib_per_token", ..., "meta"}``, ``meta`` holding argv, git commit, device and
versions; a plot beside it when matplotlib is there.

    python bench/attention.py --shape qwen3-next --T 2048 4096 8192 16384     # GPU
    python bench/attention.py --shape cpu-small --T 512 1024 2048 4096 8192   # CPU
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMPLS = ("chunkscan", "chunkscan_portable", "mlx_fast", "chunkscan_unordered")
KiB = 1024.0
# What table() and plot() read of a saved row: every row, and a row without "error".
ROW_KEYS = ("impl", "T")
MEASURED_KEYS = ("ms", "kib_per_token")
SHAPES = {
    # Qwen3-Next's full-attention layers: 16 query heads, 2 kv heads, head_dim 256.
    "qwen3-next": dict(B=1, Hq=16, Hkv=2, D=256, dtype="bfloat16", mask="causal"),
    # Small enough for a 2-core CPU up to T = 8192.
    "cpu-small": dict(B=1, Hq=4, Hkv=2, D=64, dtype="float32", mask="causal"),
}


class _NoOrdering:
    """Stands in for :mod:`chunkscan._ordering` in the negative control."""

    @staticmethod
    def _same(arrays, deps):
        return list(arrays)

    carry_after_outputs = recompute_after_cotangent = cotangent_after_gradients = _same


def measure(
    impl: str,
    T: int,
    S: int | None = None,
    B: int = 1,
    Hq: int = 16,
    Hkv: int = 2,
    D: int = 256,
    dtype: str = "bfloat16",
    mask: str | None = "causal",
    chunk_size: int | None = None,
    scratch_mib: float | None = None,
    fast_max_scores: int | None = None,
    fused_forward: str | None = None,
    compiled: bool = False,
    repeats: int = 3,
    seed: int = 0,
    phase: str = "fwdbwd",
) -> dict[str, Any]:
    """One configuration (run in its own process by :func:`main` and the tests)."""
    import mlx.core as mx

    import chunkscan
    from chunkscan.commands.measure import median_seconds, peak_above_active
    from chunkscan.ops.attention import blocked

    S = T if S is None else S
    dt = getattr(mx, dtype)
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, Hq, T, D), key=keys[0]).astype(dt)
    k = mx.random.normal((B, Hkv, S, D), key=keys[1]).astype(dt)
    v = mx.random.normal((B, Hkv, S, D), key=keys[2]).astype(dt)
    mx.eval(q, k, v)
    if scratch_mib is not None:
        blocked.SCRATCH_BYTES = int(scratch_mib * 1024 * 1024)
    if fast_max_scores is not None:
        blocked.FAST_MAX_SCORES = fast_max_scores
    if fused_forward is not None:
        blocked.FUSED_FORWARD = fused_forward
    if impl == "chunkscan_unordered":
        blocked._ordering = _NoOrdering
    scale = D**-0.5
    kernels = False if impl == "chunkscan_portable" else None
    if impl in ("chunkscan", "chunkscan_portable", "chunkscan_unordered"):

        def op(q, k, v):
            return chunkscan.attention(
                q, k, v, scale=scale, mask=mask, chunk_size=chunk_size, kernels=kernels
            )

    elif impl == "mlx_fast":

        def op(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    else:
        raise ValueError(f"[bench.attention] impl must be one of {IMPLS} but got {impl!r}.")

    grad = mx.grad(lambda q, k, v: op(q, k, v).astype(mx.float32).sum(), argnums=(0, 1, 2))
    if phase == "fwd":  # the forward alone (where its memory goes)
        grad = op
    if compiled:
        grad = mx.compile(grad)

    def call():
        return grad(q, k, v)

    mx.eval(call())  # warm-up
    _, peak = peak_above_active(call)
    seconds = median_seconds(call, repeats=repeats, warmup=0)
    n_blocks, kernel = None, False
    if impl != "mlx_fast":
        spec = blocked.check_inputs("attention", q, k, v, scale, mask, chunk_size)
        fast = blocked._use_fast(spec, dt)
        kernel = not fast and blocked.uses_cuda_kernels(spec, dt, kernels)
        n_blocks = 0 if fast or kernel else len(blocked.plan_blocks(spec))
    return {
        "impl": impl,
        "T": T,
        "S": S,
        "ms": 1000.0 * seconds,
        # per token of the whole batch: it divided by T alone, so B = 4 read 4x the
        # B = 1 figure (found by probing; the committed results all have B = 1)
        "kib_per_token": peak / KiB / (B * T),
        "tokens": B * T,
        "peak_bytes": peak,
        "blocks": n_blocks,
        "cuda_kernel": kernel,
        "scratch_bytes": blocked.scratch_bytes(),
        "device": str(mx.default_device()),
        "phase": phase,
    }


def _meta(argv: list[str]) -> dict[str, Any]:
    from _common import meta

    return meta(__file__, argv)


def scratch_mib_arg(text: str) -> float:
    """argparse ``type=`` for ``--scratch-mib``: a number > 0 that is at least one byte
    once in bytes (``int(mib * 2**20)``, what :func:`measure` sets): ``0.0000001`` was
    taken, set a scratch of 0 bytes, and every chunkscan row failed while the run exited 0
    (found by probing)."""
    from _common import positive_float

    value = positive_float(text)
    if int(value * 1024 * 1024) < 1:
        raise argparse.ArgumentTypeError(
            f"must be at least one byte (1 / 1048576 MiB) but got {text!r}, which is 0 bytes"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    from _common import Once, non_negative_int, positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu-small")
    p.add_argument(
        "--T", type=positive_int, nargs="+", action=Once, default=[512, 1024, 2048, 4096, 8192]
    )
    p.add_argument(
        "--impls", nargs="+", action=Once, default=["chunkscan", "mlx_fast"], choices=IMPLS
    )
    p.add_argument("--B", type=positive_int, default=None,
                   help="override the shape's batch size (KiB/token is per token of the "
                   "batch: the peak over B x T)")  # fmt: skip
    p.add_argument("--Hq", type=positive_int, default=None,
                   help="override the shape's query heads")  # fmt: skip
    p.add_argument("--Hkv", type=positive_int, default=None, help="override the shape's kv heads")
    p.add_argument("--D", type=positive_int, default=None, help="override the shape's head dim")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--mask", default=None, choices=["causal", "none"])
    p.add_argument("--chunk-size", type=positive_int, default=None)
    p.add_argument("--scratch-mib", type=scratch_mib_arg, nargs="+", action=Once, default=None,
                   help="chunkscan's SCRATCH_BYTES in MiB (default: the device's, "
                        "CPU_SCRATCH_BYTES or GPU_SCRATCH_BYTES); several values: each "
                        "chunkscan impl at each, in turn, at every T")  # fmt: skip
    p.add_argument("--fast-max-scores", type=non_negative_int, default=None,
                   help="chunkscan's FAST_MAX_SCORES (0: never route to mx.fast)")  # fmt: skip
    p.add_argument("--fused-forward", choices=["auto", "never"], default=None)
    p.add_argument("--compiled", action="store_true", help="mx.compile the fwd+bwd")
    p.add_argument("--phase", choices=["fwdbwd", "fwd"], default="fwdbwd",
                   help="fwd: time and memory of the forward alone")  # fmt: skip
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--fast-max-T", type=non_negative_int, default=1 << 30,
                   help="skip mlx_fast above this T (its memory is O(T^2))")  # fmt: skip
    p.add_argument("--timeout", type=positive_float, default=1800.0,
                   help="seconds per configuration")  # fmt: skip
    p.add_argument("--json", default=str(ROOT / "bench-out" / "attention.json"))
    p.add_argument("--from-json", default=None,
                   help="only rebuild the table and plot, written beside --json (which may "
                   "not name this file)")  # fmt: skip
    return p


def _shape(args: argparse.Namespace) -> dict[str, Any]:
    """``--shape``'s dimensions with the ones given over them."""
    shape = dict(SHAPES[args.shape])
    for key in ("B", "Hq", "Hkv", "D", "dtype", "mask"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    return shape


def _check_heads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Query heads a multiple of the kv heads (grouped-query attention): one error row
    per implementation and exit status 0 before (found by probing)."""
    Hq, Hkv = _shape(args)["Hq"], _shape(args)["Hkv"]
    if Hq % Hkv == 0:
        return
    shape = f" (--shape {args.shape}'s)"
    if args.Hq is not None:
        kv = f"--Hkv {Hkv}" + ("" if args.Hkv is not None else shape)
        parser.error(f"argument --Hq: {Hq} is not a multiple of {kv}")
    parser.error(f"argument --Hkv: --Hq {Hq}{shape} is not a multiple of {Hkv}")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from chunkscan.commands.measure import run_isolated

    shape = _shape(args)
    if shape["mask"] == "none":
        shape["mask"] = None
    from _common import child_env

    env = child_env()
    rows = []
    for T in args.T:
        for impl in args.impls:
            # mx.fast reads no scratch: once; chunkscan's at each value asked for
            scratches = [None] if impl == "mlx_fast" else (args.scratch_mib or [None])
            for scratch_mib in scratches:
                config = dict(shape, impl=impl, T=T, repeats=args.repeats,
                              compiled=args.compiled, chunk_size=args.chunk_size,
                              scratch_mib=scratch_mib, fast_max_scores=args.fast_max_scores,
                              fused_forward=args.fused_forward, phase=args.phase)  # fmt: skip
                if impl == "mlx_fast" and T > args.fast_max_T:
                    row = dict(config, error=f"skipped (T > --fast-max-T {args.fast_max_T})")
                else:
                    row = run_isolated(
                        "bench.attention:measure", config, timeout=args.timeout, env=env
                    )
                    row = dict(config, **row)
                rows.append(row)
                _print_row(row)
    ref = {r["T"]: r for r in rows if r["impl"] == "mlx_fast" and "ms" in r}
    for r in rows:
        if r["T"] in ref and "ms" in r:
            r["time_vs_mlx_fast"] = r["ms"] / ref[r["T"]]["ms"]
            r["memory_vs_mlx_fast"] = r["peak_bytes"] / max(ref[r["T"]]["peak_bytes"], 1.0)
    return rows


def _print_row(row: dict[str, Any]) -> None:
    if "ms" not in row:
        print(f"{row['impl']:>20} T={row['T']:>6}: {row.get('error')}", flush=True)
        return
    print(
        f"{row['impl']:>20} T={row['T']:>6}: {row['ms']:10.1f} ms "
        f"{row['kib_per_token']:9.1f} KiB/token  blocks={row.get('blocks')} "
        + (f"scratch={_scratch_mib(row)} MiB " if _scratch_mib(row) else "")
        + f"kernel={row.get('cuda_kernel')}",
        flush=True,
    )


def _scratch_mib(row: dict[str, Any]) -> str:
    """The block budget a row ran with, in MiB (rows written before session 47 recorded
    ``SCRATCH_BYTES`` itself, 32 MiB then)."""
    b = row.get("scratch_bytes")
    return "" if b is None or row.get("impl") == "mlx_fast" else f"{b / 2**20:g}"


def _phase(rows: list[dict[str, Any]]) -> str:
    """What the rows timed: "fwd" (``--phase fwd``) or "fwd+bwd" (labelled fwd+bwd
    whatever they timed before; found by probing)."""
    return "fwd" if rows and rows[0].get("phase") == "fwd" else "fwd+bwd"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"| impl | T | {_phase(rows)} (ms) | peak (KiB/token) | time / mlx_fast | blocks "
        "| scratch (MiB) | kernel |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['impl']} | {r['T']} | {r.get('error', '')[:60]} | | | | | |")
            continue
        ratio = f"{r['time_vs_mlx_fast']:.2f}x" if "time_vs_mlx_fast" in r else ""
        lines.append(
            f"| {r['impl']} | {r['T']} | {r['ms']:.1f} | {r['kib_per_token']:.1f} | {ratio} "
            f"| {r.get('blocks')} | {_scratch_mib(r)} | {'yes' if r.get('cuda_kernel') else 'no'} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: pathlib.Path, title: str) -> None:
    from _common import plot_time_and_memory

    plot_time_and_memory(rows, path, title, IMPLS, "ms", f"{_phase(rows)} time (ms)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # each T once: a repeated one was measured twice and its ratios taken against the
    # other run's reference row (found by probing; chunkscan repro drops repeats too)
    args.T = list(dict.fromkeys(args.T))
    _check_heads(parser, args)
    from _common import check_outputs, exit_status, json_text, read_saved, replotted_inputs

    # --from-json's file as an input: a --json over it put the table and plot beside it,
    # and a --json whose .md or .png is it wrote over it (found by probing); but one's
    # own last run replotted in place (bench-out/) is fine: replotted_inputs
    check_outputs(parser, {"--json": args.json}, beside=(".md", ".png"),
                  inputs=replotted_inputs(args.from_json, args.json))  # fmt: skip
    out = pathlib.Path(args.json)
    if args.from_json:
        # The table and plot go beside --json (default bench-out/), never beside the file
        # read: that overwrote committed results (found by probing). Every row with the
        # keys table() and plot() read (a KeyError before; probing).
        rows = read_saved(parser, "--from-json", args.from_json, keys=(),
                          row_keys=ROW_KEYS, measured_keys=MEASURED_KEYS)  # fmt: skip
        # and the rows beside them: a --json of another run stayed beside the new table
        # and plot (found by probing)
        if out.resolve() != pathlib.Path(args.from_json).resolve():
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json_text(rows))
    else:
        rows = run(args)
        meta = _meta(argv)
        rows = [dict(r, meta=meta) for r in rows]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json_text(rows))
    meta = rows[0].get("meta", {}) if rows else {}
    r0 = rows[0] if rows else {}
    title = (
        f"attention {_phase(rows)}, B={r0.get('B')} Hq={r0.get('Hq')} Hkv={r0.get('Hkv')} "
        f"D={r0.get('D')} {r0.get('dtype')} mask={r0.get('mask')}, {meta.get('device', '')}"
    )
    md = f"{title}\n\n    {' '.join(meta.get('argv', []))}\n\n{table(rows)}\n"
    print()
    print(md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    plot(rows, out.with_suffix(".png"), title)
    return 0 if args.from_json else exit_status(rows, "attention.py")


if __name__ == "__main__":
    sys.exit(main())
