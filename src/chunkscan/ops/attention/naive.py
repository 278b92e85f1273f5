"""``naive_attention``: ``softmax(q k^T * scale + mask) v`` in float32, the test oracle."""

from __future__ import annotations

import mlx.core as mx

from ._checks import check_inputs, empty_result

F32 = mx.float32


def naive_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | mx.array | None = None,
    chunk_size: int | None = None,
) -> mx.array:
    """Attention with the whole ``[B, Hq, T, S]`` score matrix, in float32.

    The arguments (but ``kernels`` and ``stream``), shapes and conventions of
    :func:`chunkscan.attention` (``chunk_size`` is checked and otherwise ignored)::

        s = scale * q @ k^T (+ mask, or -inf where a boolean mask is False)
        o = softmax(s) @ v            # a row with no visible key gives o = 0

    An array mask is a constant here too: no gradient flows to it (``mx.fast``'s
    attention differentiates an additive mask; the oracle did until session 49, found by
    probing). Grouped heads by broadcasting (query head ``h`` uses key/value head
    ``h // (Hq // Hkv)``). Memory ``O(B * Hq * T * S)``: for tests only.

    Returns:
        array: ``[B, Hq, T, Dv]`` in the dtype of ``q``.
    """
    spec = check_inputs("naive_attention", q, k, v, scale, mask, chunk_size)
    if (empty := empty_result(spec, q)) is not None:
        return empty
    B, Hq, Hkv, T, S, G = spec.B, spec.Hq, spec.Hkv, spec.T, spec.S, spec.G
    qf = q.astype(F32).reshape(B, Hkv, G, T, spec.D)
    kf = mx.expand_dims(k.astype(F32), 2)
    vf = mx.expand_dims(v.astype(F32), 2)
    s = (qf @ kf.swapaxes(-1, -2)) * spec.scale  # [B, Hkv, G, T, S]
    visible = None
    if spec.mask_kind == "causal":
        visible = mx.arange(S)[None, :] <= mx.arange(T)[:, None] + (S - T)
    elif spec.mask_kind == "bool":
        visible = mask_5d(mask, spec)
    elif spec.mask_kind == "additive":  # a constant, as in chunkscan.attention
        s = s + mask_5d(mx.stop_gradient(mask), spec).astype(F32)
        visible = s != -mx.inf  # a NaN (or +inf) mask entry makes its row NaN, as in MLX
    if visible is not None:
        s = mx.where(visible, s, -mx.inf)
        m = mx.max(s, axis=-1, keepdims=True)
        e = mx.exp(s - mx.where(m == -mx.inf, 0.0, m))  # rows with no key: all zero
        total = mx.sum(e, axis=-1, keepdims=True)
        p = e / mx.where(total == 0, 1.0, total)
    else:
        p = mx.softmax(s, axis=-1)
    o = p @ vf
    return o.reshape(B, Hq, T, spec.Dv).astype(q.dtype)


def mask_5d(mask: mx.array, spec) -> mx.array:
    """An array mask as ``[B or 1, Hkv or 1, G or 1, T or 1, S or 1]`` (a reshape)."""
    Bm, Hm, Tm, Sm = spec.mask_shape
    if Hm == 1:
        return mask.reshape(Bm, 1, 1, Tm, Sm)
    return mask.reshape(Bm, spec.Hkv, spec.G, Tm, Sm)
