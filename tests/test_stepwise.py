"""chunkscan.stepwise: cost linear in the chunk length, negative axes, and error text.
(Values and gradients against plain autograd are in test_scan.py.)"""

from __future__ import annotations

import os
import sys
import time

import mlx.core as mx
import pytest

import chunkscan
from chunkscan import repro
from chunkscan._measure import run_isolated


def one_chunk_backward_seconds(T: int, repeats: int = 3) -> float:
    """Best of ``repeats``: value-and-grad of ``scan(stepwise(step))`` in one chunk."""
    s0, q, k, v = repro.make_inputs(T, 1, 4)
    mx.eval(s0, q, k, v)

    def loss(s0, q, k, v):
        s, y = chunkscan.scan(chunkscan.stepwise(repro.step), s0, (q, k, v), chunk_size=T)
        return y.sum() + s.sum()

    fn = mx.grad(loss, argnums=(0, 1, 2, 3))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn(s0, q, k, v))
        best = min(best, time.perf_counter() - t0)
    return best


def test_one_chunk_backward_time_is_linear_in_its_length():
    """8x the steps in one chunk must cost about 8x, not 64x. Measured on this CPU
    after the fix: 11-12x (0.04 -> 0.47 s); before it (a flat split: one primitive
    with one output per step, O(n^2) in MLX): 145x (0.09 -> 12.9 s), and a 20000-step
    chunk ran out of memory. The bound, 40x, sits ~3.5x from both."""
    t_small = one_chunk_backward_seconds(150)
    t_large = one_chunk_backward_seconds(1200)
    assert t_large / t_small < 40, f"150 -> 1200 steps: {t_small:.3f} -> {t_large:.3f} s"


def host_memory_of_one_chunk_backward(T: int, fan_out: int | None = None) -> dict:
    """Growth of the process's peak RSS (bytes) over one gradient of a ``T``-step chunk.

    Run in a fresh process. RSS, not ``mx.get_peak_memory``: the cost being guarded is
    the graph itself (MLX's sibling lists), which lives outside MLX's allocator. The
    peak is Linux's ``VmHWM``, reset first (a forked child inherits its parent's
    ``ru_maxrss``). ``fan_out`` overrides the split's fan-out (huge: the flat split).
    """
    import importlib

    if fan_out is not None:
        importlib.import_module("chunkscan.split")._FAN_OUT = fan_out
    s0, q, k, v = repro.make_inputs(T, 1, 4)
    mx.eval(s0, q, k, v)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak RSS to the current RSS
    before = _status_bytes("VmHWM")

    def loss(s0, q, k, v):
        s, y = chunkscan.scan(chunkscan.stepwise(repro.step), s0, (q, k, v), chunk_size=T)
        return y.sum() + s.sum()

    mx.eval(mx.grad(loss, argnums=(0, 1, 2, 3))(s0, q, k, v))
    return {"rss": _status_bytes("VmHWM") - before}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # "VmHWM:  12345 kB"
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_per_step(fan_out: int | None = None) -> float:
    env = {"PYTHONPATH": os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    target = "test_stepwise:host_memory_of_one_chunk_backward"
    res = [
        run_isolated(target, {"T": T, "fan_out": fan_out}, env=env, timeout=120) for T in (150, 700)
    ]
    assert all("error" not in r for r in res), res
    return (res[1]["rss"] - res[0]["rss"]) / (700 - 150)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_one_chunk_backward_host_memory_is_linear_in_its_length():
    """Peak RSS per extra step of one chunk, from 150 to 700 steps. Measured here:
    66 KiB/step (stable to 0.1 MiB over runs); with the flat split (the negative
    control, fan-out unbounded): 216 KiB/step, growing with the chunk (O(n^2)). The
    bound, 120 KiB/step, is 1.8x from both."""
    bound = 120 * 1024
    assert rss_per_step() <= bound
    assert rss_per_step(fan_out=1 << 30) > bound
