"""Per-channel gates (Kimi Delta Attention): the group math of :mod:`.chunk` where ``g``
is ``[B, T, Hv, Dk]``, one gate per key channel.

With a gate per channel the chunk-local ``[C, C]`` products are no longer a product
scaled by one decay per row and column: each pair of steps carries its own decay per
channel. The chunk is cut into sub-chunks of :data:`_SUB` steps, within which the
decays are taken relative to the sub-chunk's start (bounded), and the pairs of
sub-chunks are assembled by :class:`_Pairs`. :func:`prepare` is the forward's WY/UT
preparation (:mod:`.chunk`'s ``_prepare`` for this gate) and :func:`group_backward`
the hand-derived backward of a group given its entering states and the cotangents of
the states leaving its chunks; ``docs/gated_delta.md``, "Per-channel gates", has the
math. The per-group functions are compiled as :mod:`.chunk`'s are (its
``_COMPILE_GROUPS``, read at each call).
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx

from .._cpu_threads import matmul
from .._finite import finite, finite_gate
from . import chunk as _chunk
from ._triangular import unit_lower_inverse
from .chunk import (
    _SUB,
    F32,
    _causal,
    _compiled,
    _input_layout,
    _state_terms,
    _strict,
    _triangle,
)


def sub_size(C: int) -> int:
    """Steps per sub-chunk for chunks of ``C`` steps (``C`` itself when ``C <= _SUB``)."""
    return C if C <= _SUB else _SUB


def prepare(q, k, v, g, beta, scale: float, *, full: bool) -> SimpleNamespace:
    """:func:`_prepare_channel_arrays` as a namespace; ``full=False`` returns only what
    the forward needs (``decay, w, u, kt, qg, p``)."""
    fn = _channel_full_arrays if full else _channel_forward_arrays
    fn = _compiled(fn) if _chunk._COMPILE_GROUPS else fn
    return SimpleNamespace(**fn(q, k, v, g, beta, scale), scale=scale)


def _channel_forward_arrays(q, k, v, g, beta, scale: float) -> dict[str, mx.array]:
    p = _prepare_channel_arrays(q, k, v, g, beta, scale)
    return {key: p[key] for key in ("decay", "w", "u", "kt", "qg", "p")}


def _channel_full_arrays(q, k, v, g, beta, scale: float) -> dict[str, mx.array]:
    return _prepare_channel_arrays(q, k, v, g, beta, scale)


def _prepare_channel_arrays(q, k, v, g, beta, scale: float) -> dict[str, mx.array]:
    """:func:`_prepare_arrays` for a per-channel gate ``g`` ``[B, n, C, Hv, Dk]``.

    With ``c_i`` the cumulative log-decay (per channel) from the chunk start through
    step ``i``, the chunk form needs the decayed products ``kk[i, j] = sum_d k_id k_jd
    exp(c_id - c_jd)`` (``j < i``) and ``qk[i, j]`` (``j <= i``). No exponent is ever
    positive (for ``g <= 0``) and none is a difference of two cumulative sums: the
    chunk is split into sub-chunks of ``b`` steps; for ``i`` in sub-chunk ``I`` and
    ``j`` in an earlier sub-chunk ``J`` ending at step ``e``, ``exp(c_i - c_j) =
    exp(c_i - c_e) exp(c_e - c_j)``, so those blocks are matmuls of scaled keys
    (``(k_I * fac) @ kr_J^T`` per pair ``J < I`` with ``fac_i = exp(c_i - c_e)`` and
    ``kr_j = k_j exp(c_e - c_j)``); inside a sub-chunk the decays ``dec[i, j]`` are
    formed elementwise (``[b, b, Dk]``). Every decay is a product of exactly the
    factors ``exp(g_s)`` it spans (``<= 1``; ``0`` for ``g = -inf``): exact to float
    rounding for any gates ``<= 0`` down to ``-inf``.

    Shapes beyond :func:`_prepare_arrays` (``m = C / b`` sub-chunks): ``gamma``,
    ``to_end``, ``g`` ``[B, Hk, G, n, C, Dk]``; ``decay`` ``[B, Hk, G, n, Dk]``;
    ``fac`` (per pair of sub-chunks ``J < I``, see :class:`_Pairs`; absent when
    ``m = 1``) ``[B, Hk, G, n, P, b, Dk]``; ``kr``, ``er`` (``exp(c_e - c_j)``)
    ``[B, Hk, G, n, m, b, Dk]``; ``dec`` ``[B, Hk, G, n, m, b, b, Dk]``; ``kk``
    ``[B, Hk, G, n, C, C]``.
    """
    B, n, C, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    G = Hv // Hk
    b = sub_size(C)
    m = C // b
    qf = finite(q).astype(F32).transpose(0, 3, 1, 2, 4)[:, :, None]
    kf = finite(k).astype(F32).transpose(0, 3, 1, 2, 4)[:, :, None]
    vf = finite(v).astype(F32).reshape(B, n, C, Hk, G, Dv).transpose(0, 3, 4, 1, 2, 5)
    gf = finite_gate(g).astype(F32).reshape(B, n, C, Hk, G, Dk).transpose(0, 3, 4, 1, 2, 5)
    bf = finite(beta).astype(F32).reshape(B, n, C, Hk, G).transpose(0, 3, 4, 1, 2)

    # Every decay is a product of exactly the factors exp(g_s) it spans (each <= 1 for
    # g <= 0, zero for g = -inf): never a positive exponent, never a quotient, and one
    # exp per gate (exp is the costliest op here on the CPU).
    gs = mx.exp(gf).reshape(B, Hk, G, n, m, b, Dk)
    r = mx.cumprod(gs, axis=-2)  # in sub-chunk I, through step i
    er = mx.cumprod(gs, axis=-2, reverse=True, inclusive=False)  # in J, after step j
    tot = r[..., -1, :]  # [.., m, Dk]: each whole sub-chunk
    before = mx.cumprod(tot, axis=-2, inclusive=False)  # the sub-chunks before I
    after = mx.cumprod(tot, axis=-2, reverse=True, inclusive=False)  # those after J
    gamma = (r * before[..., None, :]).reshape(B, Hk, G, n, C, Dk)  # steps 0..i
    to_end = (er * after[..., None, :]).reshape(B, Hk, G, n, C, Dk)  # steps j+1..
    decay = before[..., -1, :] * tot[..., -1, :]  # all steps
    ks = kf.reshape(B, Hk, 1, n, m, b, Dk)
    qs = qf.reshape(B, Hk, 1, n, m, b, Dk)
    kr = ks * er

    # Inside a sub-chunk: dec[i, j] = exp(g_{j+1}) ... exp(g_i), zero above.
    strict_b = _strict(b)[:, :, None]
    dec = mx.cumprod(_mask_where(strict_b, gs[..., :, None, :], 1.0), axis=-3)
    dec = _mask_where(_causal(b)[:, :, None], dec, 0.0)  # [.., m, b, b, Dk]
    kd = dec * ks[..., None, :, :]  # [.., m, i, j, Dk]: dec_ij k_j
    kk_blocks = [mx.sum(kd * ks[..., :, None, :], axis=-1)]  # [.., m, b, b]
    qk_blocks = [mx.sum(kd * qs[..., :, None, :], axis=-1)]

    # Pairs of sub-chunks J < I: exp(c_i - c_j) = fac_i kr_j with fac the steps
    # e_J+1..i (those of the sub-chunks strictly between J and I, then of I through
    # i) and kr_j = k_j exp(c_e - c_j): one [b, b] matmul per pair.
    pairs = _Pairs.of(m)
    fac = None
    if pairs.P:
        # between[J, I]: the sub-chunks strictly between J and I (1 unless I > J + 1).
        step = _mask_where(_later(m)[:, :, None], tot[..., None, :, :], 1.0)
        between = mx.cumprod(step, axis=-2, inclusive=False)  # [.., J, I, Dk]
        fac = pairs.by_i(r) * pairs.pick(between)[..., None, :]
        kr_t = pairs.by_j(kr).swapaxes(-1, -2)  # [.., P, Dk, b]
        kk_blocks.append((pairs.by_i(ks) * fac) @ kr_t)  # [.., P, b, b]
        qk_blocks.append((pairs.by_i(qs) * fac) @ kr_t)
    kk = pairs.assemble(kk_blocks)
    qk = pairs.assemble(qk_blocks)
    strict = _strict(C)
    a = unit_lower_inverse(mx.where(strict, bf[..., :, None] * kk, 0.0))
    kb = kf * (bf[..., None] * gamma)
    vb = vf * bf[..., None]
    return dict(
        q=qf, k=kf, v=vf, g=gf, beta=bf, gamma=gamma, to_end=to_end, decay=decay,
        kr=kr, er=er, dec=dec, kk=kk, a=a, kb=kb, vb=vb, **({} if fac is None else {"fac": fac}),
        w=matmul(a, kb), u=matmul(a, vb), qg=qf * (scale * gamma),
        p=scale * mx.where(_causal(C), qk, 0.0), kt=kf * to_end,
    )  # fmt: skip


def _mask_where(mask: mx.array, x: mx.array, fill: float) -> mx.array:
    """``where(mask, x, fill)`` for finite ``x`` as ``x * mask + fill * (1 - mask)``
    (exact: one term is zero; faster than ``where`` on the CPU)."""
    f = mask.astype(F32)
    return x * f + fill * (1.0 - f) if fill else x * f


def _later(m: int) -> mx.array:
    """``[J, I]``: ``I > J``."""
    return mx.logical_not(_triangle(m, 0))


def group_backward(p: SimpleNamespace, xs, s, d_s, d_o, v_new=None, v_back=None) -> list[mx.array]:
    """:func:`_group_backward_channel_arrays` (compiled with ``chunk._COMPILE_GROUPS``)."""
    fn = _group_backward_channel_arrays
    fn = _compiled(fn) if _chunk._COMPILE_GROUPS else fn
    arrays = {key: value for key, value in vars(p).items() if key != "scale"}
    return fn(arrays, list(xs), s, d_s, d_o, p.scale, v_new, v_back)


def _group_backward_channel_arrays(
    p: dict, xs, s, d_s, d_o, scale: float, v_new=None, v_back=None
) -> list[mx.array]:
    """:func:`_group_backward_arrays` for a per-channel gate (preparation of
    :func:`_prepare_channel_arrays`). Every gate gradient is a sum, over the pairs
    ``(i, j)`` whose decay spans a gate, of nonnegative-exponent products: reverse
    cumulative sums over the spans, never a difference of two large terms."""
    p = SimpleNamespace(**p, scale=scale)
    B, Hk, G, n, C, Dk = p.gamma.shape
    b = p.dec.shape[-2]
    m = C // b
    causal, strict = _causal(C), _strict(C)

    # Per-chunk gradients given the states, as for the scalar gate.
    v_new, d_vnew = _state_terms(p, s, d_s, d_o, v_new, v_back)
    d_w = -matmul(d_vnew, s)
    d_qg = matmul(d_o, s)
    d_p = mx.where(causal, matmul(d_o, v_new.swapaxes(-1, -2)), 0.0)
    d_kt = matmul(v_new, d_s)  # [.., C, Dk]
    d_decay = mx.sum(d_s * s, axis=-2)  # [.., Dk]

    # Back through the UT inverse and the weighted keys.
    at = p.a.swapaxes(-1, -2)
    d_kb = matmul(at, d_w)
    d_vb = matmul(at, d_vnew)
    d_a = matmul(d_w, p.kb.swapaxes(-1, -2)) + matmul(d_vnew, p.vb.swapaxes(-1, -2))
    d_l = mx.where(strict, -matmul(matmul(at, d_a), at), 0.0)
    d_beta = (
        mx.sum(d_vb * p.v, axis=-1)
        + mx.sum(d_kb * p.k * p.gamma, axis=-1)
        + mx.sum(d_l * p.kk, axis=-1)
    )
    d_gamma = p.scale * d_qg * p.q + p.beta[..., None] * d_kb * p.k
    d_kk = d_l * p.beta[..., :, None]  # strict
    d_qk = p.scale * d_p  # causal
    d_q = p.scale * d_qg * p.gamma
    d_k = d_kt * p.to_end + d_kb * (p.beta[..., None] * p.gamma)
    d_to_end = d_kt * p.k

    pairs = _Pairs.of(m)
    dkk_blocks, dqk_blocks = pairs.blocks(d_kk), pairs.blocks(d_qk)  # [.., m*m, b, b]
    qs = p.q.reshape(B, Hk, 1, n, m, b, Dk)
    ks = p.k.reshape(B, Hk, 1, n, m, b, Dk)
    d_gs = mx.zeros((B, Hk, G, n, m, b, Dk), dtype=F32)

    # Pairs of sub-chunks (J < I): kk = (k_I fac) kr_J^T, qk = (q_I fac) kr_J^T.
    if pairs.P:
        d_kkp = pairs.below(dkk_blocks)  # [.., P, b, b]
        d_qkp = pairs.below(dqk_blocks)
        krp = pairs.by_j(p.kr)
        ka = pairs.by_i(ks) * p.fac
        qa = pairs.by_i(qs) * p.fac
        d_ka = d_kkp @ krp  # [.., P, b, Dk]
        d_qa = d_qkp @ krp
        d_kr = pairs.to_j(d_kkp.swapaxes(-1, -2) @ ka + d_qkp.swapaxes(-1, -2) @ qa)
        d_k = d_k + (pairs.to_i(d_ka * p.fac) + d_kr * p.er).reshape(B, Hk, G, n, C, Dk)
        d_q = d_q + pairs.to_i(d_qa * p.fac).reshape(B, Hk, G, n, C, Dk)
        # Gates: a pair (i in I, j in J) spans the gates of J after j (through kr),
        # those of the sub-chunks strictly between, and those of I through i (fac).
        rows = ka * d_ka + qa * d_qa  # [.., P, b, Dk]: summed over j, per row i
        d_gs = d_gs + mx.cumsum(p.kr * d_kr, axis=-2, inclusive=False)  # in J, after j
        d_gs = d_gs + mx.cumsum(pairs.to_i(rows), axis=-2, reverse=True)  # in I, <= i
        through = pairs.inside @ mx.sum(rows, axis=-2)  # [.., M, Dk]: J < M < I
        d_gs = d_gs + through[..., None, :]

    # Diagonal blocks (elementwise, [b, b, Dk] per sub-chunk).
    t_kk = pairs.on_diagonal(dkk_blocks)[..., None] * p.dec  # [.., m, i, j, Dk]
    t_qk = pairs.on_diagonal(dqk_blocks)[..., None] * p.dec
    d_ks = mx.sum(t_kk * ks[..., None, :, :], axis=-2)  # as k_i
    d_ks = d_ks + mx.sum(t_kk * ks[..., :, None, :] + t_qk * qs[..., :, None, :], axis=-3)
    d_qs = mx.sum(t_qk * ks[..., None, :, :], axis=-2)
    pair_d = (t_kk * ks[..., :, None, :] + t_qk * qs[..., :, None, :]) * ks[..., None, :, :]
    spans_d = mx.cumsum(pair_d, axis=-3, reverse=True)  # [.., s, j]: sum over i >= s
    d_gs = d_gs + mx.sum(_mask_where(_strict(b)[:, :, None], spans_d, 0.0), axis=-2)
    d_k = d_k + d_ks.reshape(B, Hk, G, n, C, Dk)
    d_q = d_q + d_qs.reshape(B, Hk, G, n, C, Dk)

    # The chunk-relative decays: gamma_i spans g_0..i, to_end_j g_{j+1}.., decay all.
    d_g = d_gs.reshape(B, Hk, G, n, C, Dk)
    d_g = d_g + mx.cumsum(d_gamma * p.gamma, axis=-2, reverse=True)
    d_g = d_g + mx.cumsum(d_to_end * p.to_end, axis=-2, inclusive=False)
    d_g = d_g + (d_decay * p.decay)[..., None, :]
    d_v = d_vb * p.beta[..., None]
    d_q = mx.sum(d_q, axis=2, keepdims=True)
    d_k = mx.sum(d_k, axis=2, keepdims=True)

    return _input_layout(xs, d_q, d_k, d_v, d_g, d_beta)


class _Pairs:
    """Index constants for the ``m`` sub-chunks of a chunk and their ``P = m (m - 1) / 2``
    pairs ``J < I`` (ordered by ``I``, then ``J``)."""

    _cache: dict[int, _Pairs] = {}

    def __init__(self, m: int) -> None:
        pairs = [(j, i) for i in range(m) for j in range(i)]
        self.m, self.P, self.pairs = m, len(pairs), pairs
        # Index sets as static slices (gathers and one-hot products cost more on the
        # CPU): the pairs of I are i(i-1)/2 .. i(i+1)/2 - 1, with J = 0 .. I - 1.
        self.inside = mx.array([[float(j < r < i) for j, i in pairs] for r in range(m)])

    @classmethod
    def of(cls, m: int) -> _Pairs:
        if m not in cls._cache:
            cls._cache[m] = cls(m)
        return cls._cache[m]

    def assemble(self, parts: list[mx.array]) -> mx.array:
        """``[diagonal blocks [.., m, b, b], pair blocks [.., P, b, b]]`` -> ``[.., C, C]``
        (zero above the diagonal blocks)."""
        m, b = self.m, parts[0].shape[-1]
        batch = tuple(parts[0].shape[:-3])
        if m == 1:
            return parts[0].reshape(batch + (b, b))
        grid = [0] * (m * m)  # block (I, J) -> index into [zeros, diagonal, pairs]
        for i in range(m):
            grid[i * m + i] = 1 + i
        for p, (j, i) in enumerate(self.pairs):
            grid[i * m + j] = 1 + m + p
        stack = mx.concatenate([mx.zeros(batch + (1, b, b), dtype=F32)] + parts, axis=-3)
        blocks = mx.take(stack, mx.array(grid, dtype=mx.int32), axis=-3)
        blocks = blocks.reshape(batch + (m, m, b, b)).swapaxes(-3, -2)
        return blocks.reshape(batch + (m * b, m * b))

    def blocks(self, x: mx.array) -> mx.array:
        """``[.., C, C]`` -> its ``[b, b]`` blocks ``[.., m * m, b, b]`` (``I * m + J``)."""
        m = self.m
        batch, C = tuple(x.shape[:-2]), x.shape[-1]
        b = C // m
        x = x.reshape(batch + (m, b, m, b)).swapaxes(-3, -2)
        return x.reshape(batch + (m * m, b, b))

    def by_i(self, x: mx.array) -> mx.array:
        """``[.., m, b, D]`` -> ``[.., P, b, D]``: sub-chunk ``I`` of each pair."""
        shape = tuple(x.shape)
        parts = [
            mx.broadcast_to(x[..., i : i + 1, :, :], shape[:-3] + (i,) + shape[-2:])
            for i in range(1, self.m)
        ]
        return mx.concatenate(parts, axis=-3)

    def by_j(self, x: mx.array) -> mx.array:
        """``[.., m, b, D]`` -> ``[.., P, b, D]``: sub-chunk ``J`` of each pair."""
        return mx.concatenate([x[..., :i, :, :] for i in range(1, self.m)], axis=-3)

    def pick(self, x: mx.array) -> mx.array:
        """``[.., J, I, D]`` -> ``[.., P, D]``: entry ``(J, I)`` of each pair."""
        return mx.concatenate([x[..., :i, i, :] for i in range(1, self.m)], axis=-2)

    def below(self, blocks: mx.array) -> mx.array:
        """``[.., m * m, b, b]`` (:meth:`blocks`) -> ``[.., P, b, b]``: block ``(I, J)``."""
        m = self.m
        return mx.concatenate([blocks[..., i * m : i * m + i, :, :] for i in range(1, m)], axis=-3)

    def on_diagonal(self, blocks: mx.array) -> mx.array:
        """``[.., m * m, b, b]`` -> ``[.., m, b, b]``: the diagonal blocks."""
        m = self.m
        return mx.concatenate(
            [blocks[..., i * m + i : i * m + i + 1, :, :] for i in range(m)], axis=-3
        )

    def to_i(self, x: mx.array) -> mx.array:
        """``[.., P, b, D]`` -> ``[.., m, b, D]``: the sum over the pairs of each ``I``."""
        zero = mx.zeros(tuple(x.shape[:-3]) + (1,) + tuple(x.shape[-2:]), dtype=x.dtype)
        parts = [zero] + [
            mx.sum(x[..., i * (i - 1) // 2 : i * (i + 1) // 2, :, :], axis=-3, keepdims=True)
            for i in range(1, self.m)
        ]
        return mx.concatenate(parts, axis=-3)

    def to_j(self, x: mx.array) -> mx.array:
        """``[.., P, b, D]`` -> ``[.., m, b, D]``: the sum over the pairs of each ``J``."""
        m = self.m
        zero = mx.zeros(tuple(x.shape[:-3]) + (1,) + tuple(x.shape[-2:]), dtype=x.dtype)
        parts = []
        for j in range(m):
            terms = [x[..., i * (i - 1) // 2 + j, None, :, :] for i in range(j + 1, m)]
            parts.append(sum(terms[1:], terms[0]) if terms else zero)
        return mx.concatenate(parts, axis=-3)
