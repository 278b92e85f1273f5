"""Where the wall time of one Gated DeltaNet fwd+bwd goes on a CUDA GPU: the span of its
kernels on the device, the time some kernel runs (their union), the idle gaps between
them and how far into the call the first kernel starts (the CPU's time before the GPU
has work; added after run 47), from PyTorch's profiler (CUPTI sees MLX's kernels too:
both use the device's primary context); and how long building the lazy graph takes (the
call of the fwd+bwd function before ``mx.eval``: for eager, the op's Python and MLX's
vjp).
Eager and compiled (``mx.compile`` of the fwd+bwd).

    python3 bench/gpu_gaps.py --T 16384

``--kernels N`` also prints, per mode, the N kernels (by name) that took the most device
time in the profiled call: launches and milliseconds (added in session 26, to find why
the compiled call's kernels took longer than the eager call's, run 88: the loss's
gradient, run 89). ``--harness``: ``cotangents`` (the default since session 26: the op
alone, given its outputs' cotangents) or ``loss`` (the gradients of ``sum(o * w) +
sum(final * w_s)``, what every run before timed), as ``bench/gdn_vs_fla.py``'s.

``--json`` (default ``bench-out/gpu_gaps.json``) writes one row per mode with the
figures printed (milliseconds) and the run's provenance (``bench/_common.py``).
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import (
    OUT,
    check_outputs,
    meta,
    non_negative_int,
    positive_int,
    stop_without_cuda,
    write_json,
)


def summarise(intervals: list[tuple[float, float]]) -> tuple[float, float, list[float]]:
    """``(span, busy, gaps)`` of kernel intervals ``(start, end)`` sorted by start: the
    time from the first start to the last end, the time some interval covers (their
    union; overlaps counted once) and the idle stretches between them."""
    busy, gaps, end = 0.0, [], intervals[0][0]
    for a, b in intervals:
        if a > end:
            gaps.append(a - end)
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return end - intervals[0][0], busy, gaps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=positive_int, default=16384)
    p.add_argument("--kernels", type=non_negative_int, default=0, metavar="N")
    p.add_argument(
        "--harness", default="cotangents", choices=["cotangents", "loss"],
        help="as bench/gdn_vs_fla.py's (loss: what every run before session 26 timed)",
    )  # fmt: skip
    p.add_argument("--json", default=str(OUT / "gpu_gaps.json"))
    return p


def profile_mode(label: str, fn, xs, top_n: int) -> dict | None:
    """One mode: time ``fn(*xs)`` (graph build and wall), profile one call, print its
    line (and its ``top_n`` kernels); the row of what was printed, None where the
    profiler saw no device events."""
    import mlx.core as mx
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(3):
        mx.eval(fn(*xs))
    mx.synchronize()
    walls, builds = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        out = fn(*xs)  # the lazy graph (eager: the op's Python and MLX's vjp)
        builds.append(time.perf_counter() - t0)
        mx.eval(out)
        mx.synchronize()
        walls.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        with record_function("fwd_bwd"):
            mx.eval(fn(*xs))
            mx.synchronize()
        wall = time.perf_counter() - t0
    events = prof.events()
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    ks = sorted((e.time_range.start, e.time_range.end) for e in device)
    if not ks:
        print(f"{label}: no device events")
        return None
    call = [e.time_range.start for e in events if e.name == "fwd_bwd"]
    by_name: dict[str, list[float]] = {}
    for e in device:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    row = summary_row(label, walls, builds, wall, ks, call[0] if call else None, by_name, top_n)
    print_row(row)
    return row


def summary_row(label, walls, builds, wall, ks, call_start, by_name, top_n) -> dict:
    """The row of one mode: seconds ``walls``, ``builds``, ``wall`` (the profiled call);
    the profiler's kernel intervals ``ks`` and the call's start in microseconds,
    ``by_name`` each kernel name's durations; times in milliseconds."""
    span, busy, gaps = summarise(ks)
    big = [x for x in gaps if x > 20]
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top_n]
    return {
        "mode": label, "wall_ms": sorted(walls)[1] * 1e3, "build_ms": sorted(builds)[1] * 1e3,
        "profiled_ms": wall * 1e3,
        "first_kernel_ms": None if call_start is None else (ks[0][0] - call_start) / 1e3,
        "kernels": len(ks), "span_ms": span / 1e3, "busy_ms": busy / 1e3,
        "gaps_ms": sum(gaps) / 1e3, "gaps_over_20us": len(big),
        "gaps_over_20us_ms": sum(big) / 1e3, "largest_gap_ms": max(gaps, default=0) / 1e3,
        "top": [{"kernel": name, "ms": sum(t) / 1e3, "launches": len(t)} for name, t in top],
    }  # fmt: skip


def print_row(r: dict) -> None:
    """The lines printed before the rows were written (unchanged)."""
    first = r["first_kernel_ms"]
    lead = f", first kernel {first:.2f} ms in" if first is not None else ""
    print(
        f"{r['mode']}: wall {r['wall_ms']:.2f} ms (graph built in "
        f"{r['build_ms']:.2f}; profiled {r['profiled_ms']:.2f}{lead}), "
        f"{r['kernels']} kernels, span {r['span_ms']:.2f} ms, busy {r['busy_ms']:.2f} ms, "
        f"gaps {r['gaps_ms']:.2f} ms ({r['gaps_over_20us']} over 20 us: "
        f"{r['gaps_over_20us_ms']:.2f} ms, largest {r['largest_gap_ms']:.2f} ms)"
    )
    for k in r["top"]:
        print(f"    {k['ms']:8.3f} ms  {k['launches']:4d}x  {k['kernel'][:110]}")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if stop_without_cuda("gpu_gaps", torch=True):  # a traceback on a CPU before
        return 2
    check_outputs(p, {"--json": args.json})
    import mlx.core as mx
    from gated_delta import _inputs, make_step

    import chunkscan

    xs, w, w_s = _inputs(args.T, 1, 16, 32, 128, 128, "bfloat16", 0)
    mx.eval(xs, w, w_s)

    def op(q, k, v, g, beta, h0):
        return chunkscan.gated_delta_rule(q, k, v, g, beta, initial_state=h0)

    step = make_step(op, w, w_s, args.harness)
    rows = []
    for label, fn in (("eager", step), ("compiled", mx.compile(step))):
        row = profile_mode(label, fn, xs, args.kernels)
        if row is not None:
            rows.append(dict(row, T=args.T, harness=args.harness))
    write_json(args.json, meta(__file__, argv), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
