"""``naive_diagonal_recurrence``: the per-step float32 loop, the test oracle."""

from __future__ import annotations

import mlx.core as mx

from ._checks import F32, check_inputs


def naive_diagonal_recurrence(
    x: mx.array,
    a: mx.array,
    *,
    initial_state: mx.array | None = None,
    chunk_size: int | None = None,
) -> tuple[mx.array, mx.array]:
    """``h_t = a_t * h_{t-1} + x_t`` elementwise, one step at a time, in float32.

    The signature of :func:`chunkscan.diagonal_recurrence` (``chunk_size`` is checked
    as there and otherwise ignored). Returns ``(h [B, T, ...]`` in the dtype of ``x``,
    ``final state [B, ...]`` float32).
    """
    fn = "naive_diagonal_recurrence"
    dims = check_inputs(fn, x, a, initial_state, 1 if chunk_size is None else chunk_size)
    xf, af = x.astype(F32), a.astype(F32)
    state = dims[:1] + dims[2:]
    h = mx.zeros(state, dtype=F32) if initial_state is None else initial_state.astype(F32)
    hs = []
    for t in range(dims[1]):
        h = af[:, t] * h + xf[:, t]
        hs.append(h)
    out = mx.stack(hs, axis=1) if hs else mx.zeros(dims, dtype=F32)
    return out.astype(x.dtype), h
