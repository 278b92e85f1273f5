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

Threads: ``CHUNKSCAN_CPU_THREADS`` (``1``: no split; at most :data:`LIMIT`), else the
CPU cores this process may use, at most :data:`MAX_THREADS`; read at each call of an
op (under ``mx.compile``, when it traces). Only products on the CPU device with at
least :data:`MIN_FLOPS` floating-point operations and a batch axis of at least two are
split; the others are ``a @ b``.

MLX's streams belong to the Python thread that made them, so each Python thread that
splits a product makes streams of its own (``threads() - 1`` of them, kept for the
thread's life; MLX keeps their OS threads to the end of the process). Past
:data:`MAX_STREAMS` streams in all (many short-lived Python threads), later threads
stop splitting.
"""

from __future__ import annotations

import os
import threading

import mlx.core as mx

from .._backend import env_int, once_per_block

MAX_THREADS = 8  # the default's cap
LIMIT = 64  # the setting's
MAX_STREAMS = 256  # streams made by this module, over every Python thread
# Below this many flops (about half a millisecond of the reference BLAS) a product is
# not split: the streams' synchronisation and the concatenate would cost more.
MIN_FLOPS = 1 << 22
_LOCAL = threading.local()  # .streams: this Python thread's streams
_MADE = [0]  # streams made so far (under _LOCK)
_LOCK = threading.Lock()


def threads() -> int:
    """How many CPU threads :func:`matmul` splits a product across (see the module
    docstring); worked out once per call of an op (its settings block)."""
    return once_per_block("<cpu-threads>", _threads)


def _threads() -> int:
    n = env_int("CHUNKSCAN_CPU_THREADS", "chunkscan", "a whole number of threads such as 2")
    if n is not None:
        if not 1 <= n <= LIMIT:
            raise ValueError(
                f"[chunkscan] the environment variable CHUNKSCAN_CPU_THREADS must be from 1 "
                f"(one thread, no split) to {LIMIT} but is {n}. Unset it for the default "
                f"(the usable cores, at most {MAX_THREADS})."
            )
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def _streams(n: int) -> list[mx.Stream] | None:
    """The current stream and ``n - 1`` CPU streams of this Python thread's (made once
    per thread), or ``None`` where :data:`MAX_STREAMS` would be passed."""
    mine = getattr(_LOCAL, "streams", None)
    if mine is None:
        mine = _LOCAL.streams = []
    if len(mine) < n - 1:
        with _LOCK:
            if _MADE[0] + n - 1 - len(mine) > MAX_STREAMS:
                return None
            _MADE[0] += n - 1 - len(mine)
        while len(mine) < n - 1:
            mine.append(mx.new_stream(mx.cpu))
    return [mx.default_stream(mx.cpu), *mine[: n - 1]]


def matmul(a: mx.array, b: mx.array) -> mx.array:
    """``a @ b`` (batched, broadcasting as ``@``), split across :func:`threads` CPU
    threads where that pays (module docstring); bit for bit ``a @ b``."""
    if mx.default_device() != mx.cpu:
        return a @ b
    n = threads()
    if n < 2 or a.ndim < 2 or b.ndim < 2:
        return a @ b
    batch = mx.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1]
    for d in batch:
        flops *= d
    axis = next((i for i, d in enumerate(batch) if d >= 2), None)
    if axis is None or flops < MIN_FLOPS:
        return a @ b
    size = batch[axis]
    n = min(n, size)
    streams = _streams(n)
    if streams is None:
        return a @ b
    bounds = [size * i // n for i in range(n + 1)]
    parts = []
    for stream, lo, hi in zip(streams, bounds, bounds[1:]):
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
