"""``naive_recurrent_linear_attention``: the per-step float32 loop, the test oracle."""

from __future__ import annotations

import mlx.core as mx

from ..gated_delta._checks import empty_result
from ._checks import F32, check_inputs


def naive_recurrent_linear_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array | None = None,
    *,
    scale: float | None = None,
    initial_state: mx.array | None = None,
    chunk_size: int | None = None,
) -> tuple[mx.array, mx.array]:
    """Decayed linear attention, one token at a time, in float32.

    The signature of :func:`chunkscan.linear_attention` (``chunk_size`` is checked as
    there and otherwise ignored). Per value head ``h`` (key head ``h // (Hv // Hk)``),
    with the state ``S`` of shape ``[Dv, Dk]``::

        S = exp(g_t) * S + v_t k_t^T
        o_t = scale * S @ q_t

    Returns ``(o [B, T, Hv, Dv]`` in the dtype of ``q``, ``final state [B, Hv, Dv, Dk]``
    float32).
    """
    fn = "naive_recurrent_linear_attention"
    chunk_size = 1 if chunk_size is None else chunk_size  # checked as the op's (0 raises)
    spec, g = check_inputs(fn, q, k, v, g, scale, initial_state, chunk_size)
    if (empty := empty_result(spec, q, initial_state)) is not None:
        return empty
    G = spec.G
    qf = mx.repeat(q.astype(F32) * spec.scale, G, axis=2)
    kf = mx.repeat(k.astype(F32), G, axis=2)
    vf, decay = v.astype(F32), mx.exp(g.astype(F32))
    S = mx.zeros((spec.B, spec.Hv, spec.Dv, spec.Dk), dtype=F32)
    if initial_state is not None:
        S = initial_state.astype(F32)
    outs = []
    for t in range(spec.T):
        S = decay[:, t, :, None, None] * S + vf[:, t, :, :, None] * kf[:, t, :, None, :]
        outs.append((S @ qf[:, t, :, :, None])[..., 0])
    return mx.stack(outs, axis=1).astype(q.dtype), S
