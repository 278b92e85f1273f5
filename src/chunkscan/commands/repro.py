"""``chunkscan repro``: reproduce MLX issue #4837 and show the fix.

The reporter's recurrence (:mod:`chunkscan.commands.reporter`), a decayed delta rule
over ``T`` steps with state ``(H, D, D)`` and inputs ``q, k, v`` of shape ``(T, H, D)``,
cut into chunks of ``C`` steps, differentiated in two ways: with respect to the initial
state only, and with respect to ``q, k, v``. Every (mode, gradient case, T) runs in a
fresh process; the table shows the backward peak above the inputs, the median time
and the largest gradient difference against plain autograd.

Arguments are checked before anything runs (positive sizes, a writable ``--out``);
the exit status is 0 when every configuration ran, 1 when any failed or its gradient
is NaN or off plain autograd's by more than :data:`GRAD_TOLERANCE` (listed on stderr;
the table and repro.json are still written), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from .._backend import plain_int
from . import measure as _measure
from ._stdout import guarded_stdout
from ._stdout import say as _say  # (a closed stdout: | head; tests rebind repro._say)
from .reporter import GRADS, MODES, gradient_fn, make_inputs


def measure(
    mode: str,
    grads: str,
    T: int,
    H: int = 8,
    D: int = 128,
    chunk: int = 32,
    repeats: int = 1,
    compiled: bool = False,
    check_max_T: int = 1024,
    seed: int = 0,
    ref_dir: str | None = None,
    reference_only: bool = False,
) -> dict[str, Any]:
    """One configuration (run by :func:`chunkscan.commands.measure.run_isolated`).

    The gradients are compared with plain autograd when ``T <= check_max_T``: with
    ``ref_dir``, the ``plain`` run saves its gradients there and the other modes load
    them; where that run failed (out of memory: what the report shows), the row says
    so (``"check"``) and keeps its figures. Without ``ref_dir`` the reference is
    recomputed in this process. ``reference_only``: a ``plain`` run that only saves its
    gradients (``main``'s reference where plain is not among the modes).
    """
    s0, q, k, v = make_inputs(T, H, D, seed)
    mx.eval(s0, q, k, v)
    fn = gradient_fn(mode, grads, chunk, compiled)
    ref_path = os.path.join(ref_dir, f"{grads}-T{T}-H{H}-D{D}-s{seed}.npz") if ref_dir else None
    if reference_only:
        mx.savez(ref_path, *fn(s0, q, k, v)[1])
        return {"reference": True}
    (value, got), peak = _measure.peak_above_active(lambda: fn(s0, q, k, v))
    seconds = _measure.median_seconds(lambda: fn(s0, q, k, v), repeats=repeats, warmup=0)
    out: dict[str, Any] = {"peak_mib": peak / _measure.MiB, "seconds": seconds}
    if T > check_max_T:
        return out
    if mode == "plain":  # the reference itself: nothing to compare
        if ref_path:
            mx.savez(ref_path, *got)
        out["reference"] = True
        return out
    if ref_path is None:
        _, ref = gradient_fn("plain", grads, chunk, False)(s0, q, k, v)
    elif os.path.exists(ref_path):
        loaded = mx.load(ref_path)
        ref = [loaded[f"arr_{i}"] for i in range(len(loaded))]
    else:  # recomputing it here could only fail the same way, and lose this row
        out["check"] = "no reference: plain autograd failed"
        return out
    errors = [mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-30) for a, b in zip(got, ref)]
    out["max_grad_diff"] = worst([e.item() for e in errors])
    return out


def worst(errors: list[float]) -> float:
    """The largest error, NaN where any is NaN (Python's ``max`` drops a NaN that does
    not come first: a NaN gradient read as 0.0, found by probing)."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _number_arg(kind: type, rule: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)`` that must satisfy ``ok``, else ``rule``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule} but got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule} but got {value}")
        return value

    return parse


# ASCII digits only: int() read --T 5_0 as 50 (found by probing)
_positive_int = _number_arg(plain_int, "a positive integer", lambda v: v >= 1)
# Sizes MLX takes (shapes are 32-bit: --T 2**31 failed in every measuring process, with
# a traceback's line; found by probing, session 51).
_size = _number_arg(plain_int, "a positive integer below 2**31", lambda v: 1 <= v < 2**31)
_non_negative_int = _number_arg(plain_int, "an integer >= 0", lambda v: v >= 0)
# Python's subprocess timeouts overflow past about 24.8 days (2**31 ms): --timeout 1e9
# ended the run with an OverflowError at its first configuration (probing, session 51).
MAX_TIMEOUT = 2_000_000.0
_timeout = _number_arg(
    float, f"a positive number of seconds up to {MAX_TIMEOUT:.0f}", lambda v: 0 < v <= MAX_TIMEOUT
)


REPORT, PLOT = "repro.json", "repro.png"
# The largest relative gradient difference against plain autograd that still passes:
# the modes recompute the same float32 ops (0.0 measured for every mode on the CPU,
# bench/results/cpu/repro*/repro.json); the margin is for another backend's order of
# summation (TF32 matmuls on CUDA: ~1e-3).
GRAD_TOLERANCE = 1e-2
OUTPUTS = (REPORT, PLOT)  # what a run writes into --out


def check_out_dir(path: str) -> str | None:
    """Create ``path`` if needed and write a probe file there, and check that each of
    :data:`OUTPUTS` there is a file (not a link) or absent (a folder named
    ``repro.json`` failed the run only after every configuration had been measured);
    the problem, or None."""
    if os.path.lexists(path) and not os.path.isdir(path):  # (FileExistsError: probing)
        return f"{path} is not a folder; --out names the folder the report goes into"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    for name in OUTPUTS:
        target = os.path.join(path, name)
        # A link was written through (repro.json: into whatever file it named) or
        # replaced (repro.png), found by probing: refused, as a folder there is.
        if os.path.islink(target):
            return f"{target} is a symbolic link; remove it or pass another --out"
        if os.path.lexists(target) and not os.path.isfile(target):
            return f"{target} is not a file; remove it or pass another --out"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chunkscan repro",
        description="Reproduce MLX issue #4837 (mx.checkpoint does not bound backward "
        "memory when per-step inputs need gradients) and show chunkscan's fix. Every "
        "configuration runs in a fresh process.",
    )
    p.add_argument(
        "--T",
        type=_size,
        nargs="+",
        default=[256, 512, 1024],
        help="sequence lengths (default: 256 512 1024)",
    )
    p.add_argument("--H", type=_size, default=8, help="heads; the reporter used 32 (default: 8)")
    p.add_argument("--D", type=_size, default=128, help="head dimension (default: 128)")
    p.add_argument("--chunk", type=_positive_int, default=32, help="steps per chunk (default: 32)")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="modes to run (default: all)",
    )
    p.add_argument(
        "--grads",
        nargs="+",
        choices=list(GRADS),
        default=list(GRADS),
        help="gradient cases (default: state qkv)",
    )
    p.add_argument("--compile", action="store_true", help="mx.compile the value-and-grad step")
    p.add_argument(
        "--repeats", type=_positive_int, default=1, help="timed runs per configuration (default: 1)"
    )
    p.add_argument(
        "--check-max-T",
        type=_non_negative_int,
        default=1024,
        help="compare gradients with plain autograd up to this T (default: 1024)",
    )
    p.add_argument(
        "--out", default="repro-out", help=f"folder for {REPORT} and {PLOT} (default: repro-out)"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument(
        "--timeout", type=_timeout, default=600.0, help="seconds per configuration (default: 600)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run every configuration; 0 when all succeeded, 1 when any failed or its
    gradient is NaN or off plain autograd's (:data:`GRAD_TOLERANCE`), 2 (argparse) for
    bad arguments or an output folder that cannot be written. Stdout is guarded for the
    whole command (:func:`guarded_stdout`, as ``chunkscan lora``'s): a reader that
    leaves (``| head -1``) stops no line."""
    with guarded_stdout():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.out = os.path.expanduser(args.out)  # '~/x' was a folder named ~ here (probing)
    problem = check_out_dir(args.out)
    if problem:  # before measuring, not after every configuration has run
        parser.error(f"argument --out: cannot write to {args.out!r} ({problem})")
    # Repeats in the lists ran a configuration twice and printed its column twice.
    modes, grads_cases = list(dict.fromkeys(args.modes)), list(dict.fromkeys(args.grads))
    Ts = sorted(set(args.T))
    configs = [(m, g, T) for g in grads_cases for m in modes for T in Ts]
    _say(
        f"chunkscan repro: mlx {mx.__version__} on {mx.default_device()}, H={args.H} "
        f"D={args.D} C={args.chunk}{' compiled' if args.compile else ''}; "
        f"{len(configs)} configurations, each in a fresh process"
    )
    started = time.perf_counter()
    # The code measured: read before the run (it was read after: a commit made while
    # the fresh processes ran was recorded for every row; found by probing, session 51)
    # and again after it, both kept where they differ.
    code_before = _measure.code_commit()
    ref_dir = tempfile.mkdtemp(prefix="chunkscan-repro-")
    try:  # the plain gradients kept for the comparison go, Ctrl-C too (probing)
        rows, ref_failed = _measure_all(args, configs, modes, grads_cases, Ts, ref_dir)
    finally:
        shutil.rmtree(ref_dir, ignore_errors=True)
    _say(f"done in {time.perf_counter() - started:.0f} s\n")
    _say(format_table(rows, Ts))
    os.makedirs(args.out, exist_ok=True)
    provenance = _measure.provenance(code_before)
    if "git_commit_after" in provenance:
        print(
            f"chunkscan repro: the checkout changed during the run ({code_before} before, "
            f"{provenance['git_commit_after']} after): its rows may measure either; run it "
            "again",
            file=sys.stderr,
        )
    meta = {
        **provenance,  # its device names the machine too; mlx in versions
        "H": args.H,
        "D": args.D,
        "chunk": args.chunk,
        "compiled": args.compile,
        "modes": modes,
        "grads": grads_cases,
    }
    report = os.path.join(args.out, REPORT)
    with open(report, "w") as fh:  # strict JSON: a NaN difference was written as a bare
        # NaN, which jq, JavaScript and other strict parsers refuse (session 36's review)
        json.dump(_measure.strict_json({"meta": meta, "rows": rows}), fh, indent=1, allow_nan=False)
    _say(f"\nwrote {report}")
    png = os.path.join(args.out, PLOT)
    if os.path.isfile(png):  # an earlier run's plot would stand beside this run's JSON
        os.remove(png)
    if args.no_plot:
        pass
    elif not any("peak_mib" in r for r in rows):
        print("nothing was measured: no plot", file=sys.stderr)
    else:
        path = plot(rows, meta, png)
        if path:
            _say(f"wrote {path}")
    failed = [r for r in rows if "error" in r]
    # a gradient off plain autograd's (NaN, or more than GRAD_TOLERANCE) fails the run
    # too: it exited 0 with a NaN difference (found by probing)
    for r in rows:
        diff = r.get("max_grad_diff")
        if diff is not None and not diff <= GRAD_TOLERANCE:
            failed.append(dict(r, error=f"gradient {diff:.1e} off plain autograd's"))
    if failed or ref_failed:
        lines = [f"  {r['grads']} {r['mode']} T={r['T']}: {r['error']}" for r in failed]
        print(
            f"\nchunkscan repro: {len(failed)} of {len(rows)} configurations and "
            f"{len(ref_failed)} reference runs failed:\n" + "\n".join(lines + ref_failed),
            file=sys.stderr,
        )
        return 1
    return 0


def _measure_all(args, configs, modes, grads_cases, Ts, ref_dir) -> tuple[list, list]:
    """Every configuration in a process of its own (and the plain references, where
    plain is no mode): the rows, and the reference runs that failed."""
    rows = []
    # plain first, so that its gradients are there for the other modes to compare with;
    # where plain is not among the modes, a reference run of its own (no row)
    configs.sort(key=lambda c: c[0] != "plain")
    ref_failed: list[str] = []  # reference runs apart (no rows) that failed
    if "plain" not in modes:
        for grads, T in [(g, T) for g in grads_cases for T in Ts if T <= args.check_max_T]:
            ref = _measure.run_isolated(
                "chunkscan.commands.repro:measure",
                dict(mode="plain", grads=grads, T=T, H=args.H, D=args.D, chunk=args.chunk,
                     ref_dir=ref_dir, reference_only=True),
                timeout=args.timeout,
            )  # fmt: skip
            if "error" in ref:
                _say(f"[ref] {grads:<5} plain autograd T={T:<6} {ref['error']}")
                ref_failed.append(f"  {grads} plain autograd (reference) T={T}: {ref['error']}")
    for n, (mode, grads, T) in enumerate(configs, 1):
        res = _measure.run_isolated(
            "chunkscan.commands.repro:measure",
            dict(
                mode=mode,
                grads=grads,
                T=T,
                H=args.H,
                D=args.D,
                chunk=args.chunk,
                repeats=args.repeats,
                compiled=args.compile,
                check_max_T=args.check_max_T,
                ref_dir=ref_dir,
            ),
            timeout=args.timeout,
        )
        rows.append({"mode": mode, "grads": grads, "T": T, **res})
        status = res.get("error") or f"{res['peak_mib']:8.1f} MiB {res['seconds']:7.3f} s"
        _say(f"[{n:>2}/{len(configs)}] {grads:<5} {mode:<20} T={T:<6} {status}")
    return rows, ref_failed


def format_table(rows: list[dict], Ts: list[int]) -> str:
    """Markdown table: one line per (gradients, mode); memory, time, gradient error."""
    head = (
        "| grads | mode | "
        + " | ".join(f"T={T} MiB" for T in Ts)
        + " | "
        + " | ".join(f"T={T} s" for T in Ts)
        + " | max rel. grad diff |"
    )
    lines = [head, "|" + "---|" * (3 + 2 * len(Ts))]
    order = {name: i for i, name in enumerate([*GRADS, *MODES])}
    keys = sorted(
        dict.fromkeys((r["grads"], r["mode"]) for r in rows),
        key=lambda gm: (order[gm[0]], order[gm[1]]),
    )
    for grads, mode in keys:
        by_T = {r["T"]: r for r in rows if r["grads"] == grads and r["mode"] == mode}
        mem = [_cell(by_T.get(T), "peak_mib", "{:.1f}") for T in Ts]
        sec = [_cell(by_T.get(T), "seconds", "{:.2f}") for T in Ts]
        diffs = [r.get("max_grad_diff") for r in by_T.values() if "max_grad_diff" in r]
        # T whose reference failed: the worst difference covers the others only (it read
        # as covering every T before; found by probing)
        unchecked = [T for T in Ts if "check" in by_T.get(T, {})]
        # T above --check-max-T, measured and never compared: said too (the README's
        # own command gave a difference that read as covering T = 4096; probing)
        beyond = [T for T in Ts if T in by_T and not {"max_grad_diff", "check", "error",
                                                      "reference"} & set(by_T[T])]  # fmt: skip
        if diffs:
            diff = f"{worst(diffs):.1e}"
            if unchecked:
                diff += f" (not checked at T={', '.join(map(str, unchecked))}: no reference)"
            if beyond:
                diff += f" (not compared at T={', '.join(map(str, beyond))}: --check-max-T)"
        elif any(r.get("reference") for r in by_T.values()):
            diff = "(reference)"
        elif any("check" in r for r in by_T.values()):
            diff = "no reference"
        elif beyond:  # none compared: "n/a" with no reason before (found by probing)
            diff = "not compared (T above --check-max-T)"
        else:
            diff = "n/a"
        lines.append(f"| {grads} | {mode} | " + " | ".join(mem + sec) + f" | {diff} |")
    return "\n".join(lines)


def _cell(row: dict | None, key: str, fmt: str) -> str:
    if row is None:
        return "-"
    if "error" in row:
        return "fail"
    return fmt.format(row[key])


def plot(rows: list[dict], meta: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: skipping the plot (pip install 'chunkscan[bench]')",
            file=sys.stderr,
        )
        return None
    grads_cases = list(dict.fromkeys(r["grads"] for r in rows))
    fig, axes = plt.subplots(
        1, len(grads_cases), figsize=(6 * len(grads_cases), 4.5), squeeze=False
    )
    for ax, grads in zip(axes[0], grads_cases):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted(
                (r["T"], r["peak_mib"])
                for r in rows
                if r["grads"] == grads and r["mode"] == mode and "peak_mib" in r
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.set_title(f"gradient w.r.t. {GRADS[grads]}")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("backward peak above inputs (MiB)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"decayed delta rule, H={meta['H']} D={meta['D']} C={meta['chunk']}, "
        f"mlx {meta['versions']['mlx']} {meta['device']}{' (compiled)' if meta['compiled'] else ''}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    sys.exit(main())
