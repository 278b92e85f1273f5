"""``naive_recurrent_gated_delta_rule``: the per-step float32 loop, the test oracle."""

from __future__ import annotations

import math

import mlx.core as mx

from ..._backend import check_kernels
from .._checks import F32_MAX
from ._checks import check_inputs, empty_result

L2_EPS = 1e-6
# Whether l2_normalize scales every row whose largest magnitude passes 1 (else only those
# whose square sum would overflow, as before session 54: the tests' negative control)
_SCALE_ROWS_ABOVE_ONE = True


def l2_normalize(x: mx.array) -> mx.array:
    """``x / sqrt(sum(x**2) + eps)`` over the last axis, in float32.

    A finite row whose largest magnitude passes 1 is first divided by a power of two
    ``m`` within a factor 2 of it (``2**floor(log2)``, whose float32 ``log2`` may round
    up; held constant: the result is the same function of ``x`` for any ``m > 0``), as
    ``(x / m) / sqrt(sum((x / m)**2) + eps / m**2)``; the other rows take the plain form,
    ``m = 1``. A power of two divides exactly, so the values are the plain form's (to the
    rounding of ``rsqrt``), and the square sum of a scaled row is between 1/4 and
    ``4 D``, where the derivatives of ``rsqrt`` (``s**-1.5``, ``s**-2.5``,
    ...) of every order are normal float32 numbers. Until session 54 only rows whose
    square sum overflows (norm above ~1.8e19, which the plain form turned into zeros)
    were scaled, by their largest magnitude: the plain form's derivative went subnormal
    from norms of ~5e12, and ``dq`` / ``dk`` of rows of norm 1e14 to 1e18 were 1e-4 to
    0.4 off, their second derivatives from norms of ~2e9 (found by probing and by
    review). A row holding an infinity or a NaN keeps the plain form (non-finite, as
    before). Two reductions: the largest magnitude, then the square sum."""
    x = x.astype(mx.float32)
    big = mx.max(mx.abs(x), axis=-1, keepdims=True)
    if _SCALE_ROWS_ABOVE_ONE:
        scaled = (big > 1.0) & mx.isfinite(big)
        power = mx.power(2.0, mx.floor(mx.log2(mx.where(scaled, big, 1.0))))
    else:
        scaled = (big > 0.5 * math.sqrt(F32_MAX / max(1, x.shape[-1]))) & mx.isfinite(big)
        power = big
    m = mx.stop_gradient(mx.where(scaled, power, 1.0))
    x = x / m
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + L2_EPS / (m * m))


def naive_recurrent_gated_delta_rule(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    *,
    scale: float | None = None,
    initial_state: mx.array | None = None,
    chunk_size: int | None = None,
    normalize_qk: bool = False,
    cu_seqlens: list[int] | mx.array | None = None,
    kernels: bool | None = None,
) -> tuple[mx.array, mx.array]:
    """The Gated DeltaNet recurrence, one token at a time, in float32.

    The signature of :func:`chunkscan.gated_delta_rule` without ``save_states``, and its
    shapes and conventions (``chunk_size`` and ``kernels`` are checked as there and
    otherwise ignored). Per value
    head, with the state ``S`` of shape ``[Dv, Dk]``::

        S = exp(g_t) * S                  # g_t [Dk] (per channel): S * exp(g_t)[None, :]
        S = S + beta_t * (v_t - S @ k_t) k_t^T
        o_t = scale * S @ q_t

    Slow (``T`` sequential steps, autograd through every step); meant as the oracle.
    """
    check_kernels("naive_recurrent_gated_delta_rule", kernels)
    spec = check_inputs(
        "naive_recurrent_gated_delta_rule", q, k, v, g, beta, scale, initial_state,
        64 if chunk_size is None else chunk_size, cu_seqlens, normalize_qk=normalize_qk,
    )  # fmt: skip
    empty = empty_result(spec, q, initial_state)
    if empty is not None:
        return empty
    out_dtype = q.dtype
    qf, kf = q.astype(mx.float32), k.astype(mx.float32)
    if normalize_qk:
        qf, kf = l2_normalize(qf), l2_normalize(kf)
    if spec.G > 1:
        qf = mx.repeat(qf, spec.G, axis=2)
        kf = mx.repeat(kf, spec.G, axis=2)
    vf, gf, bf = v.astype(mx.float32), g.astype(mx.float32), beta.astype(mx.float32)
    if initial_state is None:
        h0 = mx.zeros((spec.n_states, spec.Hv, spec.Dv, spec.Dk), dtype=mx.float32)
    else:
        h0 = initial_state.astype(mx.float32)

    def run(rows: slice, lo: int, hi: int, state: mx.array) -> tuple[mx.array, mx.array]:
        outs = []
        for t in range(lo, hi):
            q_t, k_t, v_t = qf[rows, t], kf[rows, t], vf[rows, t]  # [b, Hv, D]
            g_t = gf[rows, t]  # [b, Hv] or, per key channel, [b, Hv, Dk]
            decay = mx.exp(g_t)[..., None, :] if spec.channel else mx.exp(g_t)[..., None, None]
            state = state * decay
            pred = (state @ k_t[..., None])[..., 0]  # [b, Hv, Dv]
            delta = bf[rows, t][..., None] * (v_t - pred)
            state = state + delta[..., :, None] * k_t[..., None, :]
            outs.append(spec.scale * (state @ q_t[..., None])[..., 0])
        return mx.stack(outs, axis=1), state

    if spec.seqs is None:
        o, final = run(slice(None), 0, spec.T, h0)
    else:
        os, finals = [], []
        for n, (lo, hi) in enumerate(spec.seqs):
            o_n, s_n = run(slice(0, 1), lo, hi, h0[n : n + 1])
            os.append(o_n)
            finals.append(s_n)
        o, final = mx.concatenate(os, axis=1), mx.concatenate(finals, axis=0)
    return o.astype(out_dtype), final
