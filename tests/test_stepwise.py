"""chunkscan.stepwise: cost linear in the chunk length, negative axes, and error text.
(Values and gradients against plain autograd are in test_scan.py.)"""

from __future__ import annotations

import re
import time

import mlx.core as mx
import pytest

import chunkscan
from chunkscan import repro


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
