"""``linear_attention``: decayed linear attention, chunkwise, through ``chunkscan.scan``.

Per chunk of ``C`` tokens, with the state ``S`` (``[Dv, Dk]`` per value head) entering
it, the gates' sums ``b_i = g_1 + ... + g_i`` from the chunk's start, and every sum a
sum of exactly the gates it spans (never a difference of two cumulative sums, so a very
negative gate, or ``-inf``, a reset, costs no precision and no NaN)::

    o_i   = scale * (exp(b_i) S q_i + sum_{j <= i} exp(g_{j+1} + ... + g_i) (q_i . k_j) v_j)
    S_out = exp(b_C) S + sum_j exp(g_{j+1} + ... + g_C) v_j k_j^T

That is a handful of batched products per chunk; :func:`chunkscan.scan` runs the chunks
one after another and keeps, for the backward, the ``T / C`` states entering them plus
one chunk's recomputation (MLX's autograd of the chunk, inside ``scan``'s ordered,
checkpointed backward).
"""

from __future__ import annotations

import mlx.core as mx

from ...scan import scan
from ..gated_delta._checks import empty_result
from ._checks import F32, check_inputs


def default_chunk_size() -> int:
    """The chunk :func:`linear_attention` takes by default: 64 on the CPU (the fastest
    there: 2.59 s at T = 2048, 16 heads of 128, against 3.52 with 128 and 5.05 with 256),
    256 on a GPU, where the per-chunk ops' launches dominate (an H100 at T = 8192:
    0.037-0.039 s against 0.211 with 64, 0.123 with 128, 0.030 with 512 at twice the
    memory; run 115, bench/results/h100/linear_attention_h100_C*_da9f968*). Apple GPUs
    take the GPU's, unmeasured there."""
    return 64 if mx.default_device() == mx.cpu else 256


def linear_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array | None = None,
    *,
    scale: float | None = None,
    initial_state: mx.array | None = None,
    chunk_size: int | None = None,
) -> tuple[mx.array, mx.array]:
    """Linear attention with a scalar log-decay per head and token, chunkwise.

    Values and gradients (of ``q``, ``k``, ``v``, ``g`` and ``initial_state``) match,
    to float tolerance, :func:`naive_recurrent_linear_attention`: per value head ``h``
    (key head ``h // (Hv // Hk)``), with the state ``S`` of shape ``[Dv, Dk]``::

        S = exp(g_t) * S + v_t k_t^T
        o_t = scale * S @ q_t

    ``g=None`` is plain (causal) linear attention; a constant ``g`` per head is
    RetNet's / Lightning attention's decay (mlx-lm's ``recurrent_gla`` of the Bailing
    linear models, with ``S`` its state transposed); ``g_t = -inf`` resets the state at
    token ``t``. Backward memory: the ``T / C`` float32 states entering the chunks plus
    one chunk's recomputation (``chunkscan.scan``), not one state per token as in a
    per-token loop. Works eagerly, under ``mx.compile`` and ``nn.value_and_grad``; not
    under ``mx.vmap`` / ``mx.jvp`` or ``shapeless=True`` (as ``scan``).

    Args:
        q (array): Queries ``[B, T, Hk, Dk]``.
        k (array): Keys ``[B, T, Hk, Dk]`` (not normalized here).
        v (array): Values ``[B, T, Hv, Dv]``, ``Hv`` a multiple of ``Hk``.
        g (array, optional): Log-decays ``[B, T, Hv]`` (``<= 0`` keeps the state
            bounded; a positive gate grows it, and its ``exp`` of a chunk's sum may
            overflow float32). Default: ``None``, no decay.
        scale (float, optional): Query scale. Default: ``Dk ** -0.5``.
        initial_state (array, optional): ``[B, Hv, Dv, Dk]`` (value dim first, as in
            :func:`chunkscan.gated_delta_rule`). Default: zeros.
        chunk_size (int, optional): Tokens per chunk, a performance knob (the
            ``C x C`` products grow with it, the states kept for the backward shrink).
            Default: ``None``, :func:`default_chunk_size`: 64 on the CPU, 256 on a GPU.

    Returns:
        tuple: ``(o, final_state)``: ``o`` ``[B, T, Hv, Dv]`` in the dtype of ``q``, the
        final state ``[B, Hv, Dv, Dk]`` in float32. Inputs may be float32, bfloat16 or
        float16 (``q``, ``k``, ``v`` one dtype); the products and the state are float32.

    Example:
        >>> o, state = chunkscan.linear_attention(q, k, v, g)  # g: [B, T, Hv]
    """
    fn = "linear_attention"
    if chunk_size is None:
        chunk_size = default_chunk_size()
    spec, g = check_inputs(fn, q, k, v, g, scale, initial_state, chunk_size)
    if (empty := empty_result(spec, q, initial_state)) is not None:
        return empty
    B, Hk, G, Dv, Dk = spec.B, spec.Hk, spec.G, spec.Dv, spec.Dk
    s0 = mx.zeros((B, spec.Hv, Dv, Dk), dtype=F32)
    if initial_state is not None:
        s0 = initial_state.astype(F32)
    scale = spec.scale

    def chunk(s, xs):
        qc, kc, vc, gc = xs  # [B, C, Hk, Dk] twice, [B, C, Hv, Dv], [B, C, Hv]
        C = qc.shape[1]
        # Heads first, the value heads of a key head together: [B, Hk, G, C, .]
        qh = qc.astype(F32).transpose(0, 2, 1, 3)[:, :, None]
        kh = kc.astype(F32).transpose(0, 2, 1, 3)[:, :, None]
        vh = vc.astype(F32).reshape(B, C, Hk, G, Dv).transpose(0, 2, 3, 1, 4)
        gh = gc.astype(F32).reshape(B, C, Hk, G).transpose(0, 2, 3, 1)
        sh = s.reshape(B, Hk, G, Dv, Dk)
        b = mx.cumsum(gh, axis=-1)  # g_1 + ... + g_i
        to_end = mx.cumsum(gh, axis=-1, reverse=True, inclusive=False)  # g_{j+1} + ... + g_C
        # g_{j+1} + ... + g_i for i >= j: down each column the cumulative sum of g_i (i > j)
        i = mx.arange(C)[:, None]
        j = mx.arange(C)[None, :]
        spans = mx.cumsum(mx.where(i > j, gh[..., :, None], 0.0), axis=-2)
        decay = mx.exp(mx.where(i >= j, spans, -mx.inf))  # [B, Hk, G, C, C]
        scores = (qh @ kh.swapaxes(-1, -2)) * decay
        inter = (qh @ sh.swapaxes(-1, -2)) * mx.exp(b)[..., None]
        o = scale * (scores @ vh + inter)  # [B, Hk, G, C, Dv]
        written = (vh * mx.exp(to_end)[..., None]).swapaxes(-1, -2) @ kh
        s = mx.exp(b[..., -1])[..., None, None] * sh + written
        o = o.transpose(0, 3, 1, 2, 4).reshape(B, C, spec.Hv, Dv)
        return s.reshape(B, spec.Hv, Dv, Dk), o.astype(q.dtype)

    final, o = scan(chunk, s0, (q, k, v, g), chunk_size=spec.chunk_size, axis=1)
    return o, final
