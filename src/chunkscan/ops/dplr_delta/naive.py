"""``naive_recurrent_dplr_delta_rule``: the per-step float32 loop, the test oracle."""

from __future__ import annotations

import mlx.core as mx

from ._checks import F32, check_inputs


def naive_recurrent_dplr_delta_rule(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    g: mx.array,
    *,
    initial_state: mx.array | None = None,
    chunk_size: int | None = None,
) -> tuple[mx.array, mx.array]:
    """The delta rule with a diagonal-plus-low-rank transition, one step at a time, in
    float32.

    The signature of :func:`chunkscan.dplr_delta_rule` (``chunk_size`` is checked as
    there and otherwise ignored). Per head, with the state ``S`` of shape ``[Dv, Dk]``::

        S = S * exp(g[t])[None, :] + outer(S @ a[t], b[t]) + outer(v[t], k[t])
        o[t] = S @ q[t]

    Returns ``(o [B, T, H, Dv]`` in the dtype of ``q``, ``final state [B, H, Dv, Dk]``
    float32).
    """
    fn = "naive_recurrent_dplr_delta_rule"
    batch, T, h, dk, dv = check_inputs(
        fn, q, k, v, a, b, g, initial_state, 1 if chunk_size is None else chunk_size
    )
    qf, kf, vf, af, bf, gf = (x.astype(F32) for x in (q, k, v, a, b, g))
    S = (
        mx.zeros((batch, h, dv, dk), dtype=F32)
        if initial_state is None
        else initial_state.astype(F32)
    )
    outs = []
    for t in range(T):
        Sa = (S * af[:, t, :, None, :]).sum(-1)  # [B, H, Dv]
        S = (
            S * mx.exp(gf[:, t, :, None, :])
            + Sa[..., None] * bf[:, t, :, None, :]
            + vf[:, t, :, :, None] * kf[:, t, :, None, :]
        )
        outs.append((S * qf[:, t, :, None, :]).sum(-1))
    o = mx.stack(outs, axis=1) if outs else mx.zeros((batch, 0, h, dv), dtype=F32)
    return o.astype(q.dtype), S
