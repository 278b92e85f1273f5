"""``diagonal_recurrence``: the elementwise linear recurrence ``h_t = a_t * h_{t-1} +
x_t`` (RG-LRU's and minGRU's scan; LRU's with real decays), chunked.

How: :func:`chunkscan.scan` over chunks of ``chunk_size`` steps (the backward keeps the
state entering each chunk and recomputes one chunk at a time). Within a chunk the steps
are combined by a log-depth inclusive scan (:func:`inclusive_scan`), so a chunk is a
constant number of batched ops, not ``L`` steps: only products of the ``a_t`` and sums,
never a division. The backward is MLX's autograd of that chunk.
"""

from __future__ import annotations

import mlx.core as mx

from ...scan import scan
from ._checks import F32, check_inputs


def default_chunk_size() -> int:
    """The chunk :func:`diagonal_recurrence` takes by default: 64. Its state is one
    token's size, so the carries cost little, and a chunk's recomputation holds about
    ``4 ceil(log2 chunk_size)`` arrays of the chunk's size; on a GPU each chunk is about
    ``4 ceil(log2 chunk_size)`` launches."""
    return 64


def inclusive_scan(a: mx.array, b: mx.array) -> tuple[mx.array, mx.array]:
    """``(a_0 ... a_t, h_t)`` along axis 1 for ``h_t = a_t h_{t-1} + b_t``, ``h_{-1} = 0``:
    the decay from the chunk's start to ``t`` and the state at ``t`` from zero
    (Hillis-Steele: ``ceil(log2 L)`` rounds of ``(a, b)_t <- (a_t a_{t-s}, a_t b_{t-s} +
    b_t)``; each reads only earlier steps, so a non-finite value reaches what the loop's
    steps reach)."""
    L = a.shape[1]
    step = 1
    while step < L:
        a_prev, b_prev = a[:, :-step], b[:, :-step]
        a_now, b_now = a[:, step:], b[:, step:]
        b = mx.concatenate([b[:, :step], a_now * b_prev + b_now], axis=1)
        a = mx.concatenate([a[:, :step], a_now * a_prev], axis=1)
        step *= 2
    return a, b


def _chunk(h, xs):
    """One chunk: the state leaving it and its states (float32)."""
    x, a = (v.astype(F32) for v in xs)
    decay, states = inclusive_scan(a, x)
    states = states + decay * h[:, None]
    return states[:, -1], states


def diagonal_recurrence(
    x: mx.array,
    a: mx.array,
    *,
    initial_state: mx.array | None = None,
    chunk_size: int | None = None,
) -> tuple[mx.array, mx.array]:
    """The elementwise linear recurrence ``h_t = a_t * h_{t-1} + x_t`` over axis 1, with
    a backward whose memory is the state entering each chunk plus one chunk's
    recomputation.

    Values and gradients (of ``x``, ``a`` and ``initial_state``) match
    :func:`chunkscan.ops.diagonal.naive_diagonal_recurrence`, the per-step loop, to
    float32 rounding; non-finite values reach exactly what the loop's steps reach for
    ``|a| <= 1`` (a chunk multiplies up to ``chunk_size`` of the ``a_t``, which can
    overflow for growing states where the loop's steps stay finite). Computed in
    float32 whatever the inputs' dtype. Works eagerly, under ``mx.compile`` and
    ``nn.value_and_grad``; ``mx.vmap`` / ``mx.jvp`` are not supported (as
    :func:`chunkscan.scan`).

    Args:
        x (array): ``[B, T, ...]`` inputs; float32, bfloat16 or float16.
        a (array): ``[B, T, ...]`` (``x``'s shape) decays.
        initial_state (array, optional): ``[B, ...]``; default zeros.
        chunk_size (int, optional): Steps per chunk (need not divide ``T``). Default:
            :func:`default_chunk_size` (64).

    Returns:
        tuple: ``(h [B, T, ...]`` every state, in ``x``'s dtype, ``final state [B, ...]``
        float32).

    Raises:
        TypeError: an argument is not an ``mx.array``, or ``chunk_size`` not an int.
        ValueError: a shape or dtype out of the layout above, or ``chunk_size < 1``.
    """
    fn = "diagonal_recurrence"
    given = 1 if chunk_size is None else chunk_size  # None: the default; 0 or False raise
    dims = check_inputs(fn, x, a, initial_state, given)
    chunk_size = default_chunk_size() if chunk_size is None else int(chunk_size)
    state = dims[:1] + dims[2:]
    h0 = mx.zeros(state, dtype=F32) if initial_state is None else initial_state.astype(F32)
    if dims[1] == 0:
        return mx.zeros(dims, dtype=x.dtype), h0
    h, states = scan(_chunk, h0, (x, a), chunk_size=chunk_size, axis=1)
    return states.astype(x.dtype), h
