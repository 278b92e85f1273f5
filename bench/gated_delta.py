"""Gated DeltaNet fwd+bwd time and backward peak memory per token against T.

Implementations (``--impls``), each configuration in a fresh process
(:func:`chunkscan.commands.measure.run_isolated`):

- ``chunkscan``: :func:`chunkscan.gated_delta_rule` (chunk form, ordered backward);
- ``mlx_lm``: mlx-lm's ``gated_delta_ops`` (per-token loop; its training path),
  when mlx-lm is installed. It takes ``exp(g)`` and a pre-scaled ``q``; the
  conversion is part of the measured function;
- ``mlx_fast``: ``mx.fast.gated_delta_update`` (MLX's fused op; same conventions);
- ``scan``: the per-token recurrence through :func:`chunkscan.scan` +
  :func:`chunkscan.stepwise`.

Shape: one Qwen3-Next layer (B=1, Hk=16, Hv=32, Dk=Dv=128) by default. The loss is
``sum(o * w) + sum(final_state * w_s)``; gradients for q, k, v, g, beta and the
initial state. Memory: ``mx.get_peak_memory()`` above the active memory before the
call (inputs excluded; forward, backward and the gradients themselves included),
after one warm-up call. Time: median of ``--repeats`` warm calls. Ratios are
against ``mlx_lm`` at the same T in the same run.

    python bench/gated_delta.py                                   # T = 512 ... 8192
    python bench/gated_delta.py --T 1024 --impls chunkscan mlx_lm --repeats 3
    python bench/gated_delta.py --openblas auto                   # Linux CPU only

``--openblas PATH|auto`` preloads an OpenBLAS (``LD_PRELOAD``) into each measured
process: MLX's Linux CPU wheel bundles the single-threaded reference BLAS. It does
nothing useful on Metal or CUDA; leave it off there.
"""

from __future__ import annotations

import argparse
import glob
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out"  # default outputs (git-ignored); committed runs name their paths
IMPLS = ("chunkscan", "mlx_lm", "mlx_fast", "scan")
KiB = 1024.0
# What table() and plot() read of a saved row: every row, and a row without "error".
ROW_KEYS = ("impl", "T")
MEASURED_KEYS = ("seconds", "kib_per_token")


def _inputs(
    T: int, B: int, Hk: int, Hv: int, Dk: int, Dv: int, dtype: str, seed: int, gate: str = "head"
):
    import mlx.core as mx

    dt = getattr(mx, dtype)
    keys = mx.random.split(mx.random.key(seed), 8)
    q = mx.random.normal((B, T, Hk, Dk), key=keys[0])
    k = mx.random.normal((B, T, Hk, Dk), key=keys[1])
    k = k * mx.rsqrt(mx.sum(k * k, axis=-1, keepdims=True))
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2])
    g_shape = (B, T, Hv, Dk) if gate == "channel" else (B, T, Hv)
    g = -mx.random.uniform(0.01, 0.3, g_shape, key=keys[3])
    beta = mx.random.uniform(0.05, 1.0, (B, T, Hv), key=keys[4])
    h0 = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=keys[5])
    w = mx.random.normal((B, T, Hv, Dv), key=keys[6]).astype(dt)
    w_s = mx.random.normal((B, Hv, Dv, Dk), key=keys[7])
    xs = [x.astype(dt) for x in (q, k, v, g, beta)] + [h0]
    return xs, w, w_s


def make_step(op, w, w_s, harness: str):
    """``f(*inputs)``: the fwd+bwd of ``op`` (``(q, k, v, g, beta, h0) -> (o, final)``,
    on :func:`_inputs`' arrays; ``w``, ``w_s`` the weights it returns) under
    ``harness``: ``"cotangents"``, ``((o, final), gradients)`` given ``w`` and ``w_s`` as
    the outputs' cotangents; ``"loss"``, ``(loss, gradients)`` of ``sum(o * w) +
    sum(final * w_s)``. The same six gradients (``bench/gdn_vs_fla.py``'s two
    harnesses)."""
    import mlx.core as mx

    if harness == "cotangents":
        return lambda *xs: mx.vjp(op, list(xs), [w, w_s])

    def loss(*xs):
        o, s = op(*xs)
        return mx.sum((o * w).astype(mx.float32)) + mx.sum(s * w_s)

    return mx.value_and_grad(loss, argnums=tuple(range(6)))


def scan_chunk_size(chunk_size: int | None) -> int:
    """The chunk the per-token ``scan`` implementation runs at (at most 32 steps: its
    per-step graph is large)."""
    return min(chunk_size or 32, 32)


def _op(impl: str, Dk: int, chunk_size: int | None, save: str | None = None):
    """``f(q, k, v, g, beta, h0) -> (o, final_state)`` with chunkscan's conventions
    (``save``: chunkscan's ``save_states``)."""
    import mlx.core as mx

    scale = Dk**-0.5
    if impl == "chunkscan":
        import chunkscan

        def f(q, k, v, g, beta, h0):
            return chunkscan.gated_delta_rule(
                q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size, save_states=save
            )

    elif impl == "mlx_lm":
        from mlx_lm.models.gated_delta import gated_delta_ops

        def f(q, k, v, g, beta, h0):
            return gated_delta_ops(q * scale, k, v, mx.exp(g), beta, h0)

    elif impl == "mlx_fast":

        def f(q, k, v, g, beta, h0):
            return mx.fast.gated_delta_update(q * scale, k, v, mx.exp(g), beta, h0)

    elif impl == "scan":
        import chunkscan

        def step(state, x):
            q_t, k_t, v_t, g_t, b_t = x  # [B, Hk, Dk], [B, Hv, Dv], [B, Hv]
            rep = v_t.shape[1] // k_t.shape[1]
            q_t = mx.repeat(q_t.astype(mx.float32), rep, axis=1)
            k_t = mx.repeat(k_t.astype(mx.float32), rep, axis=1)
            state = state * mx.exp(g_t.astype(mx.float32))[..., None, None]
            pred = (state @ k_t[..., None])[..., 0]
            delta = b_t.astype(mx.float32)[..., None] * (v_t.astype(mx.float32) - pred)
            state = state + delta[..., :, None] * k_t[..., None, :]
            o_t = scale * (state @ q_t[..., None])[..., 0]
            return state, o_t.astype(v_t.dtype)

        run = chunkscan.stepwise(step, axis=1)

        def f(q, k, v, g, beta, h0):
            final, o = chunkscan.scan(
                run, h0, (q, k, v, g, beta), axis=1, chunk_size=scan_chunk_size(chunk_size)
            )
            return o, final

    else:
        raise ValueError(f"[bench.gated_delta] impl must be one of {IMPLS} but got {impl!r}.")
    return f


def measure(
    impl: str,
    T: int,
    dtype: str = "bfloat16",
    repeats: int = 2,
    chunk_size: int | None = None,
    B: int = 1,
    Hk: int = 16,
    Hv: int = 32,
    Dk: int = 128,
    Dv: int = 128,
    seed: int = 0,
    gate: str = "head",
    save: str | None = None,
) -> dict[str, Any]:
    """One configuration (run in its own process by :func:`main`); ``save``: what
    chunkscan's forward keeps for the backward (its ``save_states``; None: the default)."""
    import mlx.core as mx

    from chunkscan.commands.measure import median_seconds, peak_above_active

    xs, w, w_s = _inputs(T, B, Hk, Hv, Dk, Dv, dtype, seed, gate)
    mx.eval(xs, w, w_s)
    f = _op(impl, Dk, chunk_size, save)

    grad = make_step(f, w, w_s, "loss")

    def call():
        return grad(*xs)

    mx.eval(call())  # warm-up (compiles mlx-lm's step, fills kernel caches)
    _, peak = peak_above_active(call)
    seconds = median_seconds(call, repeats=repeats, warmup=0)
    return {
        "impl": impl,
        "T": T,
        "dtype": dtype,
        "chunk_size": _chunk_used(impl, chunk_size),
        "chunk_run": _chunk_run(impl, chunk_size, xs),
        "gate": gate,
        "save": save,
        "seconds": seconds,
        "peak_bytes": peak,
        "kib_per_token": peak / KiB / T,
        "device": str(mx.default_device()),
    }


def _chunk_used(impl: str, chunk_size: int | None) -> int | None:
    """The chunk size asked of the implementation, the op's default where none was
    given (``None``: not chunked); :func:`_chunk_run` is the one it ran at."""
    if impl == "scan":
        return scan_chunk_size(chunk_size)
    if impl == "chunkscan":
        if chunk_size:
            return chunk_size
        from chunkscan.ops.gated_delta.chunk import default_chunk_size

        return default_chunk_size()
    return None


def _chunk_run(impl: str, chunk_size: int | None, xs) -> int | None:
    """The chunk the implementation ran at on ``xs`` (``None``: not chunked): the op cuts
    a chunk to T and, for a per-channel gate, rounds it up to whole sub-chunks of 8, so
    the size asked for is not always the one run (``chunk_size: 32`` at T = 16; found
    by probing). Rows written before it have no ``chunk_run``."""
    if impl == "scan":
        return min(scan_chunk_size(chunk_size), xs[0].shape[1])  # scan cuts it to T too
    if impl == "chunkscan":
        _bench_on_path()  # measure() runs as bench.gated_delta in its own process
        from _common import gdn_chunking

        return gdn_chunking(*xs[:5], chunk_size=chunk_size).C
    return None


def _find_openblas(value: str | None) -> str | None:
    """The library ``--openblas`` names (an absolute path), found for ``auto``; a
    ``SystemExit`` saying why where there is none. A missing library, or a file that is
    not one, is dropped by the loader with a warning in the child's stderr, and the run
    used the bundled BLAS while the title said OpenBLAS (found by probing; a file that
    is not a shared library, and a bare name the loader looks up on its own path, in
    session 49)."""
    if not value:
        return None
    if value != "auto":
        path = pathlib.Path(value).expanduser()
        if not path.is_file():
            raise SystemExit(f"--openblas {value}: no such file.")
        try:
            with open(path, "rb") as fh:
                head = fh.read(4)
        except OSError as e:  # unreadable: a traceback before (review)
            raise SystemExit(f"--openblas {value}: cannot read it ({e.strerror}).") from None
        if head != b"\x7fELF":
            raise SystemExit(f"--openblas {value} is not a shared library (no ELF header).")
        return str(path.resolve())
    for pattern in (
        "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/usr/lib/*-linux-gnu/libopenblas.so.0",
        "/usr/lib64/libopenblas*.so.0",
    ):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    raise SystemExit(
        "--openblas auto found no libopenblas.so.0; install "
        "libopenblas0-pthread (Debian/Ubuntu) or pass the library path."
    )


def build_parser() -> argparse.ArgumentParser:
    from _common import Once, add_save_option, non_negative_int, positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--T", type=positive_int, nargs="+", action=Once, default=[512, 1024, 2048, 4096, 8192]
    )
    p.add_argument("--impls", nargs="+", action=Once, default=list(IMPLS), choices=IMPLS)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument(
        "--chunk-size",
        type=positive_int,
        default=None,
        help="chunkscan's chunk (default: the op's default for the device)",
    )
    p.add_argument(
        "--gate",
        default="head",
        choices=["head", "channel"],
        help="g per value head [B, T, Hv] or per key channel [B, T, Hv, Dk] (Kimi Delta "
        "Attention; chunkscan and mlx_lm only)",
    )
    p.add_argument(
        "--loop-max-T",
        type=non_negative_int,
        default=2048,
        help="largest T for the per-token loops (mlx_lm, mlx_fast, scan); their memory "
        "grows by ~8 MiB per token at this shape",
    )
    add_save_option(p)
    p.add_argument("--openblas", default=None, help="path to libopenblas.so.0, or 'auto'")
    p.add_argument("--timeout", type=positive_float, default=1800.0,
                   help="seconds per configuration")  # fmt: skip
    p.add_argument("--json", default=str(OUT / "gated_delta.json"))
    p.add_argument("--png", default=str(OUT / "gated_delta.png"),
                   help="the plot: a path ending in .png, .pdf, .svg, .jpg or .jpeg; '' for "
                   "none")  # fmt: skip
    p.add_argument("--md", default=str(OUT / "gated_delta.md"))
    p.add_argument(
        "--from-json",
        default=None,
        help="do not measure: rebuild the table and plot from a JSON file this script "
        "wrote (the outputs go elsewhere: --json, --md and --png may not name it)",
    )
    return p


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from chunkscan.commands.measure import run_isolated

    env = {}
    if args.openblas:  # (the library main found and checked)
        env["LD_PRELOAD"] = args.openblas
    from _common import child_env

    env.update(child_env())
    rows = []
    for T in args.T:
        for impl in args.impls:
            config = {"impl": impl, "T": T, "dtype": args.dtype, "repeats": args.repeats}
            if impl != "chunkscan" and T > args.loop_max_T:
                row = dict(config, error=f"skipped (T > --loop-max-T {args.loop_max_T})")
                rows.append(row)
                _print_row(row)
                continue
            config["chunk_size"] = args.chunk_size
            config["gate"] = args.gate
            for save in args.save if impl == "chunkscan" else [None]:
                cfg = dict(config, save=save)
                row = run_isolated("bench.gated_delta:measure", cfg, timeout=args.timeout, env=env)
                row.update({k: v for k, v in cfg.items() if k not in row})
                row["openblas"] = args.openblas or None
                rows.append(row)
                _print_row(row)
    _add_ratios(rows)
    return rows


def _print_row(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['impl']:>10} T={row['T']:>6}: {row['error']}", flush=True)
        return
    print(
        f"{row['impl']:>10} T={row['T']:>6}: {row['seconds']:8.3f} s "
        f"{row['kib_per_token']:9.1f} KiB/token"
        + (f"  save={row['save']}" if row.get("save") else ""),
        flush=True,
    )


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    ref = {r["T"]: r for r in rows if r.get("impl") == "mlx_lm" and "error" not in r}
    for r in rows:
        base = ref.get(r["T"])
        if base and "error" not in r:
            r["speedup_vs_mlx_lm"] = base["seconds"] / r["seconds"]
            r["memory_vs_mlx_lm"] = r["peak_bytes"] / base["peak_bytes"]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| impl | T | fwd+bwd (s) | peak (KiB/token) | speedup vs mlx_lm | memory vs mlx_lm |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['T']} | {r['error']} | | | |")
            continue
        sp = f"{r['speedup_vs_mlx_lm']:.2f}x" if "speedup_vs_mlx_lm" in r else ""
        mem = f"{r['memory_vs_mlx_lm']:.3f}" if "memory_vs_mlx_lm" in r else ""
        name = r["impl"] + (f" (save={r['save']})" if r.get("save") else "")
        lines.append(
            f"| {name} | {r['T']} | {r['seconds']:.3f} | {r['kib_per_token']:.1f} | {sp} | {mem} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    from _common import plot_time_and_memory

    plot_time_and_memory(
        rows, path, title, IMPLS, "seconds", "fwd+bwd time (s)", "backward peak (KiB / token)"
    )


def _bench_on_path() -> None:
    """``bench/`` on ``sys.path``, for ``_common``."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))


def main(argv: list[str] | None = None) -> int:
    _bench_on_path()  # _common, for the parser too
    parser = build_parser()
    args = parser.parse_args(argv)
    # each T once: a repeated one was measured twice and its ratios taken against the
    # other run's reference row (found by probing; chunkscan repro drops repeats too)
    args.T = list(dict.fromkeys(args.T))
    if args.gate == "channel" and not set(args.impls) <= {"chunkscan", "mlx_lm"}:
        parser.error(  # exit status 2, as argparse's own (it was 1; found by probing)
            "argument --impls: --gate channel runs chunkscan and mlx_lm only but got "
            f"{' '.join(args.impls)}. Pass --impls chunkscan mlx_lm."
        )
    if args.openblas and not args.from_json:
        # before any output is made, exit status 2 (it came at the first measurement,
        # exit 1, its output folder made; found by probing, session 49)
        try:
            args.openblas = _find_openblas(args.openblas)
        except SystemExit as e:
            parser.error(f"argument {e.code}")
    from _common import check_outputs, exit_status, json_text, read_saved, replotted_inputs

    # --from-json's file as an input: an output over it rewrote it, its table or plot in
    # its place; --png's suffix: matplotlib refused it after the measuring (both found by
    # probing). One's own last run replotted in place (--json naming the file read,
    # outside bench/results/) is fine: that file is not written again (replotted_inputs).
    inputs = replotted_inputs(args.from_json, args.json)
    if args.from_json and not inputs:
        # its --json not written again, but no other output over it: --md naming it
        # replaced the rows with the table, exit 0 (found by probing, session 49)
        args.json, inputs = "", (args.from_json,)
    check_outputs(
        parser,
        {"--json": args.json, "--png": args.png, "--md": args.md},
        optional=("--json", "--png", "--md"),
        inputs=inputs,
        plots=("--png",),
    )
    if args.from_json:
        # every row with the keys table() and plot() read (a KeyError before; probing)
        saved = read_saved(parser, "--from-json", args.from_json, keys=("rows", "title"),
                           row_keys=ROW_KEYS, measured_keys=MEASURED_KEYS)  # fmt: skip
        rows, title, info = saved["rows"], saved["title"], saved.get("meta", saved.get("argv"))
    else:
        from _common import meta

        rows, info = run(args), meta(__file__, argv)
        blas = "OpenBLAS preloaded" if args.openblas else "bundled BLAS"
        gate = ", per-channel gate" if args.gate == "channel" else ""
        title = f"Gated DeltaNet layer (B=1, Hk=16, Hv=32, D=128, {args.dtype}{gate}), {blas}"
    md = f"{title}\n\n{table(rows)}\n"
    print()
    print(md)
    for path in (args.json, args.png, args.md):
        if path:
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.json:
        pathlib.Path(args.json).write_text(json_text({"meta": info, "title": title, "rows": rows}))
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(md)
    if args.png:
        plot(rows, args.png, title)
    return 0 if args.from_json else exit_status(rows, "gated_delta.py")


if __name__ == "__main__":
    sys.exit(main())
