"""``dplr_delta_rule``: the delta rule with a diagonal-plus-low-rank transition (RWKV-7's
"generalized delta rule"), chunked.

Per head, with the state ``S`` of shape ``[Dv, Dk]``::

    S_t = S_{t-1} (diag(exp(g_t)) + a_t b_t^T) + v_t k_t^T
    o_t = S_t q_t

How: :func:`chunkscan.scan` over chunks of ``chunk_size`` tokens (the backward keeps the
state entering each chunk and recomputes one chunk at a time, by MLX's autograd). Within
a chunk the low-rank term is an input like ``v_t k_t^T``: with ``u_t = S_{t-1} a_t``,
``S_t = S_{t-1} diag(exp(g_t)) + u_t b_t^T + v_t k_t^T``, and the ``u_t`` of all the
chunk's tokens solve one unit lower triangular system (``u_t`` reads ``u_i`` of the
tokens before it through ``b_i``), inverted by
:func:`chunkscan.ops.gated_delta._triangular.unit_lower_inverse` in products only. Then
the outputs and the state leaving the chunk are matrix products.

Decays are per key channel, so the matrices between the chunk's tokens need them per
pair of tokens and channel: ``exp`` of ``g`` summed over exactly the tokens between the
two (a cumulative sum down ``[t, i] -> g_t (t > i)``, never a difference of two
cumulative sums), one ``[L, L + 1, Dk]`` array per head for a chunk of ``L``. Nothing
divides by a decay, so any ``g <= 0`` works, ``-inf`` included (that key channel's
decay is zero: its column of the state keeps only what the token writes).
"""

from __future__ import annotations

import mlx.core as mx

from ...scan import scan
from ..gated_delta._triangular import unit_lower_inverse
from ._checks import F32, check_inputs


def default_chunk_size() -> int:
    """The chunk :func:`dplr_delta_rule` takes by default: 8 on the CPU, 32 on a GPU.
    The pairwise decays cost ``chunk_size`` per token and channel, the states kept one
    per chunk. On the CPU (2 cores, 32 heads of 64, float32, the op alone, all six
    gradients; ``bench/dplr_delta.py``,
    ``bench/results/cpu/dplr_delta{,_c4,_c16,_c32}_922ff05.json``) T = 1024 took 3.43 s
    at 105 KiB/token with 8, 3.13 s / 163 with 4, 4.85 s / 221 with 16, 8.27 s / 339
    with 32 (mlx-lm's loop: 16.9 s at 13221 KiB/token). On an H100, where each op is a
    launch, RWKV-7 1.5B's layer in bfloat16 at T = 4096 (``bench/rwkv7.py``, run 121):
    1.73 s at 181 KiB/token with 8, 0.92 / 320 with 16, 0.50 / 422 with 32, 0.27 / 1348
    with 64; at T = 1024 0.119 s / 487 with 32 against mlx-lm's loop's 0.465 s / 6852
    (which ran out of the 80 GB at 4096). Apple GPUs take the GPU's, unmeasured there."""
    return 8 if mx.default_device() == mx.cpu else 32


def _pair_decays(g: mx.array) -> tuple[mx.array, mx.array]:
    """``(before, through)``, each ``[B, H, L, L + 1, Dk]``: the decay from after column
    ``i`` (column 0: the state entering the chunk; column ``i + 1``: token ``i``) to
    just before token ``t``'s own decay, and through it. ``1`` where ``i >= t``."""
    L = g.shape[2]
    later = mx.arange(L)[:, None] > mx.arange(-1, L)[None, :]  # [L, L + 1]
    spans = mx.where(later[:, :, None], g[:, :, :, None, :], 0.0)
    before = mx.exp(mx.cumsum(spans, axis=2, inclusive=False))
    through = mx.exp(mx.cumsum(spans, axis=2))
    return before, through


def _chunk(S, xs):
    """One chunk: the state leaving it and its outputs ``[B, L, H, Dv]`` (float32)."""
    q, k, v, a, b, g = (x.astype(F32).swapaxes(1, 2) for x in xs)  # [B, H, L, D]
    L = q.shape[2]
    before, through = _pair_decays(g)
    token = mx.arange(L)
    strict = token[:, None] > token[None, :]
    causal = token[:, None] >= token[None, :]
    St = S.swapaxes(-1, -2)  # [B, H, Dk, Dv]
    # u_t = S_{t-1} a_t: the entering state's part, v_i's and u_i's (i < t)
    a_dec = a[:, :, :, None, :] * before
    a_b = mx.where(strict, (a_dec[:, :, :, 1:] * b[:, :, None]).sum(-1), 0.0)
    a_k = mx.where(strict, (a_dec[:, :, :, 1:] * k[:, :, None]).sum(-1), 0.0)
    u = unit_lower_inverse(-a_b) @ (a_dec[:, :, :, 0] @ St + a_k @ v)  # [B, H, L, Dv]
    # o_t = S_t q_t, with i <= t
    q_dec = q[:, :, :, None, :] * through
    q_b = mx.where(causal, (q_dec[:, :, :, 1:] * b[:, :, None]).sum(-1), 0.0)
    q_k = mx.where(causal, (q_dec[:, :, :, 1:] * k[:, :, None]).sum(-1), 0.0)
    o = q_dec[:, :, :, 0] @ St + q_b @ u + q_k @ v
    end = through[:, :, -1]  # [B, H, L + 1, Dk]: from each column to the chunk's end
    S = (
        S * end[:, :, None, 0]
        + u.swapaxes(-1, -2) @ (b * end[:, :, 1:])
        + v.swapaxes(-1, -2) @ (k * end[:, :, 1:])
    )
    return S, o.swapaxes(1, 2)


def dplr_delta_rule(
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
    """The delta rule with a diagonal-plus-low-rank transition (RWKV-7's generalized
    delta rule), with a backward whose memory is the state entering each chunk plus one
    chunk's recomputation.

    Per head, with the state ``S`` of shape ``[Dv, Dk]``, values and gradients match,
    to float32 rounding for contracting transitions such as RWKV-7's (but the initial
    state's gradient at key heads well below the chunk: docs/dplr_delta.md, "Limitations"),
    this loop (:func:`naive_recurrent_dplr_delta_rule`)::

        for t in range(T):
            S = S * exp(g[t])[None, :] + outer(S @ a[t], b[t]) + outer(v[t], k[t])
            o[t] = S @ q[t]

    RWKV-7 is ``q = r``, ``g = log(w)``, ``a = -kk``, ``b = kk * iclr`` (mlx-lm's
    ``Rwkv7TimeMixing._wkv7``; :func:`chunkscan.mlx_lm.patch` routes it here). ``q`` is
    not scaled. Computed in float32 whatever the inputs' dtype. Works eagerly, under
    ``mx.compile`` and ``nn.value_and_grad``; ``mx.vmap`` / ``mx.jvp`` are not supported
    (as :func:`chunkscan.scan`).

    Args:
        q (array): ``[B, T, H, Dk]`` queries (RWKV's receptance).
        k (array): ``[B, T, H, Dk]`` keys; ``q``, ``k`` and ``v`` share a float dtype.
        v (array): ``[B, T, H, Dv]`` values.
        a (array): ``[B, T, H, Dk]``: the state is read along ``a`` ...
        b (array): ``[B, T, H, Dk]``: ... and that read written back along ``b``.
        g (array): ``[B, T, H, Dk]`` log-decays per key channel (``<= 0`` to decay;
            ``-inf``: that channel's column of the state keeps only the token's writes,
            the low-rank one reading the state before the decay).
        initial_state (array, optional): ``[B, H, Dv, Dk]``; default zeros.
        chunk_size (int, optional): Tokens per chunk (need not divide ``T``); the
            recomputation of one holds about twelve float32 arrays of
            ``[B, H, chunk_size, chunk_size + 1, Dk]``. Default:
            :func:`default_chunk_size` (8 on the CPU, 32 on a GPU).

    Returns:
        tuple: ``(o [B, T, H, Dv]`` in ``q``'s dtype, ``final state [B, H, Dv, Dk]``
        float32).

    Raises:
        TypeError: an argument is not an ``mx.array``, or ``chunk_size`` not an int.
        ValueError: a shape or dtype out of the layout above, or ``chunk_size < 1``.
    """
    fn = "dplr_delta_rule"
    given = 1 if chunk_size is None else chunk_size  # None: the default; 0 or False raise
    batch, T, h, dk, dv = check_inputs(fn, q, k, v, a, b, g, initial_state, given)
    chunk_size = default_chunk_size() if chunk_size is None else int(chunk_size)
    S0 = (
        mx.zeros((batch, h, dv, dk), dtype=F32)
        if initial_state is None
        else initial_state.astype(F32)
    )
    if T == 0 or batch == 0 or h == 0:  # (the triangular inverse cannot reshape an empty
        return mx.zeros((batch, T, h, dv), dtype=q.dtype), S0  # batch; found by probing)
    S, o = scan(_chunk, S0, (q, k, v, a, b, g), chunk_size=chunk_size, axis=1)
    return o.astype(q.dtype), S
