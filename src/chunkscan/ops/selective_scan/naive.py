"""``naive_selective_scan``: the per-step float32 loop, the test oracle."""

from __future__ import annotations

import mlx.core as mx

from ._checks import F32, check_inputs


def naive_selective_scan(
    x: mx.array,
    dt: mx.array,
    A: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array | None = None,
    *,
    initial_state: mx.array | None = None,
    chunk_size: int | None = None,
) -> tuple[mx.array, mx.array]:
    """Mamba's selective scan, one step at a time, in float32.

    The signature of :func:`chunkscan.selective_scan` (``chunk_size`` is checked as
    there and otherwise ignored). Per channel ``c`` and state index ``n``::

        h_t[c, n] = exp(dt_t[c] A[c, n]) h_{t-1}[c, n] + dt_t[c] x_t[c] B_t[n]
        y_t[c] = sum_n h_t[c, n] C_t[n] + D[c] x_t[c]

    Returns ``(y [B, T, Dc]`` in the dtype of ``x``, ``final state [B, Dc, N]`` float32).
    """
    fn = "naive_selective_scan"
    batch, T, dc, n = check_inputs(
        fn, x, dt, A, B, C, D, initial_state, 1 if chunk_size is None else chunk_size
    )
    xf, dtf, Af, Bf, Cf = (a.astype(F32) for a in (x, dt, A, B, C))
    h = mx.zeros((batch, dc, n), dtype=F32) if initial_state is None else initial_state.astype(F32)
    ys = []
    for t in range(T):
        h = mx.exp(dtf[:, t, :, None] * Af) * h + (dtf[:, t] * xf[:, t])[..., None] * Bf[:, t, None]
        ys.append((h * Cf[:, t, None]).sum(-1))
    y = mx.stack(ys, axis=1) if ys else mx.zeros((batch, 0, dc), dtype=F32)
    if D is not None:
        y = y + D.astype(F32) * xf
    return y.astype(x.dtype), h
