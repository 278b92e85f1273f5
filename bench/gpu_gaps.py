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
"""

from __future__ import annotations

import argparse
import time


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--kernels", type=int, default=0, metavar="N")
    p.add_argument(
        "--harness", default="cotangents", choices=["cotangents", "loss"],
        help="as bench/gdn_vs_fla.py's (loss: what every run before session 26 timed)",
    )  # fmt: skip
    args = p.parse_args()
    import mlx.core as mx
    import torch
    from gated_delta import _inputs, make_step
    from torch.profiler import ProfilerActivity, profile, record_function

    import chunkscan

    xs, w, w_s = _inputs(args.T, 1, 16, 32, 128, 128, "bfloat16", 0)
    mx.eval(xs, w, w_s)

    def op(q, k, v, g, beta, h0):
        return chunkscan.gated_delta_rule(q, k, v, g, beta, initial_state=h0)

    step = make_step(op, w, w_s, args.harness)
    for label, fn in (("eager", step), ("compiled", mx.compile(step))):
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
            continue
        span, busy, gaps = summarise(ks)
        big = [x for x in gaps if x > 20]
        call = [e.time_range for e in events if e.name == "fwd_bwd"]
        lead = f", first kernel {(ks[0][0] - call[0].start) / 1e3:.2f} ms in" if call else ""
        print(
            f"{label}: wall {sorted(walls)[1] * 1e3:.2f} ms (graph built in "
            f"{sorted(builds)[1] * 1e3:.2f}; profiled {wall * 1e3:.2f}{lead}), "
            f"{len(ks)} kernels, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
            f"gaps {sum(gaps) / 1e3:.2f} ms ({len(big)} over 20 us: {sum(big) / 1e3:.2f} ms, "
            f"largest {max(gaps, default=0) / 1e3:.2f} ms)"
        )
        by_name: dict[str, list[float]] = {}
        for e in device:
            by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[: args.kernels]
        for name, times in top:
            print(f"    {sum(times) / 1e3:8.3f} ms  {len(times):4d}x  {name[:110]}")


if __name__ == "__main__":
    main()
