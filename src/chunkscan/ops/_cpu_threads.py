"""Batched matrix products split across CPU threads.

MLX's CPU back-end runs each op on one thread (its stream's), and a batched matmul is
a loop of single-threaded BLAS calls (MLX's Linux wheel bundles the reference BLAS):
on a CPU the portable ops use one core however many there are. :func:`matmul` cuts a
large batched product along a batch axis into one slice per thread, computes each slice
on a CPU stream of its own (MLX gives each stream a thread) and joins them with one
concatenate. The slices are the same BLAS calls on the same rows as ``a @ b``, so the
result is bit for bit the same.

Why each product and not each half of the op (half of the heads on each stream): MLX's
``eval`` queues the ops in the order of its tape, with at most 10 in flight, and its
tape (a breadth-first walk of width 20, ``MLX_BFS_MAX_WIDTH``) runs long stretches of
one half before the other: two halves of a Gated DeltaNet call on two streams barely
overlapped unless that width was raised tenfold. The slices of one product are
adjacent in the tape, so they run side by side.

Threads: ``CHUNKSCAN_CPU_THREADS`` (read at each call; ``1``: no split), else the
CPU cores this process may use, at most :data:`MAX_THREADS`. Only products on the CPU
device with at least :data:`MIN_FLOPS` floating-point operations and a batch axis of
at least two are split; the others are ``a @ b``.
"""

from __future__ import annotations

import os

import mlx.core as mx

from .._backend import env_int

MAX_THREADS = 8
# Below this many flops (about half a millisecond of the reference BLAS) a product is
# not split: the streams' synchronisation and the concatenate would cost more.
MIN_FLOPS = 1 << 22
_STREAMS: list[mx.Stream] = []


def threads() -> int:
    """How many CPU threads :func:`matmul` splits a product across (see the module
    docstring)."""
    n = env_int("CHUNKSCAN_CPU_THREADS", "chunkscan", "a whole number of threads such as 2")
    if n is not None:
        if n < 1:
            raise ValueError(
                f"[chunkscan] the environment variable CHUNKSCAN_CPU_THREADS must be at "
                f"least 1 (1: one thread, no split) but is {n}. Unset it for the default."
            )
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def _streams(n: int) -> list[mx.Stream]:
    """The current stream and ``n - 1`` CPU streams of this module's (made once)."""
    while len(_STREAMS) < n - 1:
        _STREAMS.append(mx.new_stream(mx.cpu))
    return [mx.default_stream(mx.cpu), *_STREAMS[: n - 1]]


def matmul(a: mx.array, b: mx.array) -> mx.array:
    """``a @ b`` (batched, broadcasting as ``@``), split across :func:`threads` CPU
    threads where that pays (module docstring); bit for bit ``a @ b``."""
    if mx.default_device() != mx.cpu:
        return a @ b
    batch = mx.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1]
    for d in batch:
        flops *= d
    axis = next((i for i, d in enumerate(batch) if d >= 2), None)
    if axis is None or flops < MIN_FLOPS:
        return a @ b
    n = min(threads(), batch[axis])
    if n < 2:
        return a @ b
    size = batch[axis]
    bounds = [size * i // n for i in range(n + 1)]
    parts = []
    for stream, lo, hi in zip(_streams(n), bounds, bounds[1:]):
        parts.append(
            mx.matmul(_rows(a, axis, len(batch), lo, hi), _rows(b, axis, len(batch), lo, hi),
                      stream=stream)
        )  # fmt: skip
    return mx.concatenate(parts, axis=axis)


def _rows(x: mx.array, axis: int, n_batch: int, lo: int, hi: int) -> mx.array:
    """Entries ``lo:hi`` of batch axis ``axis`` (of the broadcast batch of ``n_batch``
    axes) of ``x``, or ``x`` itself where it broadcasts along that axis."""
    i = axis - (n_batch - (x.ndim - 2))
    if i < 0 or x.shape[i] == 1:
        return x
    return x[(slice(None),) * i + (slice(lo, hi),)]
