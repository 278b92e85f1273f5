"""``linear_attention``: decayed linear attention, chunk-parallel, backward by hand.

Per chunk of ``C`` tokens, with the state ``S`` (``[Dv, Dk]`` per value head) entering
it, the gates' sums ``b_i = g_1 + ... + g_i`` from the chunk's start, and every sum a
sum of exactly the gates it spans (never a difference of two cumulative sums, so a very
negative gate, or ``-inf``, a reset, costs no precision and no NaN)::

    o_i   = scale * (exp(b_i) S q_i + sum_{j <= i} exp(g_{j+1} + ... + g_i) (q_i . k_j) v_j)
    S_out = a S + W,   a = exp(b_C),   W = sum_j exp(g_{j+1} + ... + g_C) v_j k_j^T

The decay ``a`` of a chunk is one number per head, so the states entering the chunks of
a group are one product: ``S_c = sum_{m <= c} Lambda[c, m] X_m`` with ``X = [S_in, W_0,
..., W_{n-2}]`` and ``Lambda[c, m] = a_m * ... * a_{c-1}`` (each the ``exp`` of a sum of
exactly its chunks' gate sums). Every stage of a group is a constant number of batched
ops, whatever its number of chunks; only the groups run one after the other.

The backward is derived by hand (no autograd of any part of the op): per group, last to
first, it recomputes the group's chunk states from the state entering the group (the
only thing the forward keeps), forms ``R_c = scale (dO_c * e_c)^T Q_c`` (``e_i =
exp(b_i)``), the cotangents of the states leaving the chunks in one product of the
same form run backwards (``dS_c = R_{c+1} + a_{c+1} dS_{c+1}``), and then every
chunk's gradients at once::

    dA = scale dO V^T * D                 (D[i, j] = exp(g_{j+1} + ... + g_i), i >= j)
    dq = dA K + scale e * (dO S)          dk = dA^T Q + f * (V dS)
    dv = scale A^T dO + f * (K dS^T)      (A = Q K^T * D, f_j = exp(g_{j+1} + ... + g_C))
    dg_l = sum_{i >= l > j} dA_ij (q_i . k_j) + sum_{i >= l} q_i . (scale e_i dO_i S)
           + sum_{j < l} k_j . (f_j V_j dS) + a sum(dS * S)

Memory: the state entering each group (kept by the forward), the inputs' gradients and
one group's scratch; groups are sized by a byte budget and ordered by the rules of
:mod:`chunkscan._ordering`.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx

from ... import _ordering
from ..._backend import env_group_mib
from ...split import slices_at, split_at, sqrt_blocks
from .._finite import bad_rows, finite, finite_gate
from ..gated_delta._checks import empty_result
from ..gated_delta.chunk import _non_finite_reach
from ._checks import F32, check_inputs

_NAN = mx.array(float("nan"), dtype=F32)

# Scratch of one group of chunks in bytes; None: CHUNKSCAN_LA_GROUP_MIB, else 16 MiB on
# the CPU (where a group's size does not change its speed: T = 2048, 16 heads of 128,
# C = 64, bf16: 2.63-2.67 s with 8 or 16 MiB, one chunk a group, at 41.3 KiB/token,
# 2.70-2.73 with 64 at 54.0), else 256 MiB on a GPU. There every group costs its
# launches, but MLX's CUDA back-end holds every buffer of a command graph until the
# graph has run, so larger groups hold more at once: an H100 at T = 8192 / 32768, C =
# 256, took 16 / 63 ms at 93.0 / 48.5 KiB/token with 256 MiB, 8 / 31 ms at 491 / 347 with
# the Gated DeltaNet op's 1/8 of the GPU's memory, and 35 / 151 ms at 64.3 / 38.9 with
# 128 MiB and C = 64 (run 118, bench/results/h100/linear_attention_h100_*_8780652*). A hook
# for the tests.
_GROUP_BYTES: int | None = None
_CPU_GROUP_BYTES = 16 << 20
_GPU_GROUP_BYTES = 256 << 20
# At most this many chunks times C per group: the states entering a group's chunks are
# one [n, n] by [n, Dv * Dk] product per head, whose work per token grows with n (at
# n = C it is that of the product of the queries with the states).
_CHUNKS_PER_C = 1
# Whether the backward's block of the saved states' cotangents waits for the cotangent
# flowing into the block's last group (rule 2); the tests switch it off as the negative
# control (test_backward_memory_is_one_group).
_WAIT_SAVED_COTANGENTS = True


def default_chunk_size() -> int:
    """The chunk :func:`linear_attention` takes by default: 64 on the CPU (its fastest,
    measured on the scan-based form before session 42: T = 2048, 16 heads of 128, 2.59 s
    against 3.52 with 128 and 5.05 with 256), 256 on a GPU (with the GPU's 256 MiB groups
    the least memory of 64, 128 and 256 at about their time: an H100 at T = 8192 / 32768,
    16 / 63 ms at 93.0 / 48.5 KiB/token against 13 / 47 at 125.8 / 98.2 with 128; run
    118). Apple GPUs take the GPU's, unmeasured there."""
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
    token ``t``. The chunks of a group are computed together (a constant number of
    batched ops per group) and the backward is derived by hand. Backward memory: the
    inputs' gradients, the state entering each group and one group's scratch (groups
    sized by a byte budget), not one state per token as in a per-token loop. Works
    eagerly, under ``mx.compile``, ``nn.value_and_grad`` and second derivatives; not
    under ``mx.vmap`` / ``mx.jvp`` (a custom function's vjp only).

    Args:
        q (array): Queries ``[B, T, Hk, Dk]``.
        k (array): Keys ``[B, T, Hk, Dk]`` (not normalized here).
        v (array): Values ``[B, T, Hv, Dv]``, ``Hv`` a multiple of ``Hk``.
        g (array, optional): Log-decays ``[B, T, Hv]`` (``<= 0`` keeps the state
            bounded; a positive gate grows it, and its ``exp`` over a chunk, or over a
            group's chunks, may overflow float32). Default: ``None``, no decay.
        scale (float, optional): Query scale. Default: ``Dk ** -0.5``.
        initial_state (array, optional): ``[B, Hv, Dv, Dk]`` (value dim first, as in
            :func:`chunkscan.gated_delta_rule`). Default: zeros.
        chunk_size (int, optional): Tokens per chunk, a performance knob (the
            ``C x C`` products grow with it). Default: ``None``,
            :func:`default_chunk_size`: 64 on the CPU, 256 on a GPU.

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
    # Read, and so checked, before a call of no tokens returns (as gated_delta_rule
    # does; a bad value passed at T = 0 and raised at the first real call: review).
    _group_mib_setting()
    if (empty := empty_result(spec, q, initial_state)) is not None:
        return empty
    s0 = mx.zeros((spec.B, spec.Hv, spec.Dv, spec.Dk), dtype=F32)
    if initial_state is not None:
        s0 = initial_state.astype(F32)
    # Non-finite input reads as zero inside the op; NaN goes back where the per-step
    # loop has it (Gated DeltaNet's rule, no beta here).
    o_bad, final_bad = _non_finite_reach(spec, q, k, v, g, None)
    core = _make_core(spec, _groups(spec), q.dtype)
    o, final = core(q, k, v, g, s0, o_bad)[:2]
    return o, mx.where(final_bad[..., None, None], _NAN, final)


def _groups(spec) -> list[tuple[int, int, int]]:
    """The groups as ``(first token, number of chunks, chunk size)``: whole chunks of
    ``C`` in groups of at most ``_CHUNKS_PER_C * C`` chunks within the byte budget, then
    the tokens past the last whole chunk as one short chunk of their own (no padding)."""
    C, D = spec.chunk_size, max(spec.Dk, spec.Dv)
    # about eight [C, C], fourteen [C, D] and six [D, D] float32 arrays per chunk and head
    per_chunk = 4 * spec.B * spec.Hv * (8 * C * C + 14 * C * D + 6 * spec.Dk * spec.Dv)
    budget = _GROUP_BYTES
    if budget is None:
        budget = _group_mib_setting()
    if budget is None:
        budget = _CPU_GROUP_BYTES if mx.default_device() == mx.cpu else _GPU_GROUP_BYTES
    size = max(1, min(int(_CHUNKS_PER_C * C), budget // per_chunk))
    whole = spec.T // C
    groups = [(c * C, min(size, whole - c), C) for c in range(0, whole, size)]
    if spec.T % C:
        groups.append((whole * C, 1, spec.T % C))
    return groups


def _group_mib_setting() -> int | None:
    """``CHUNKSCAN_LA_GROUP_MIB`` (at least 1) in bytes, ``None`` where unset."""
    mib = env_group_mib("CHUNKSCAN_LA_GROUP_MIB", "linear_attention")
    return None if mib is None else mib << 20


def _make_core(spec, groups: list[tuple[int, int, int]], out_dtype: mx.Dtype):
    """The custom function ``(q, k, v, g, s0, o_bad) -> [o, final, *blocks]``: the
    inputs in the op's layout, ``s0`` ``[B, Hv, Dv, Dk]`` float32, ``o_bad [B, T, Hv]``
    where the outputs are NaN (:func:`_non_finite_reach`); after ``o`` and the final
    state the state entering each group after the first, kept for the backward, stacked
    in blocks (:func:`chunkscan.split.sqrt_blocks`)."""
    B, Hk, G, Hv, Dk, Dv = spec.B, spec.Hk, spec.G, spec.Hv, spec.Dk, spec.Dv
    scale = spec.scale
    cuts = [t0 for t0, _, _ in groups[1:]]

    def heads_first(q, k, v, g, n, C):
        """A group's inputs ``[B, n * C, ...]`` as float32 ``[B, Hk, G or 1, n, C, ...]``,
        non-finite values read as zero (and NaN or ``+inf`` gates)."""
        # (Transposed views, not copies: a copy made once per group ran 2.5% faster on
        # the CPU, but the backward then made every group's copies up front, unless
        # ordered by a rule of its own: 1.94 MiB growth in test_backward_memory_is_one_group
        # at C = 16, against 1.16.)
        q, k = (finite(x.astype(F32)).reshape(B, n, C, Hk, 1, Dk).transpose(0, 3, 4, 1, 2, 5)
                for x in (q, k))  # fmt: skip
        v = finite(v.astype(F32)).reshape(B, n, C, Hk, G, Dv).transpose(0, 3, 4, 1, 2, 5)
        g = finite_gate(g.astype(F32)).reshape(B, n, C, Hk, G).transpose(0, 3, 4, 1, 2)
        return SimpleNamespace(q=q, k=k, v=v, g=g)

    def per_head_mask(bad, n, C):
        """A group's ``o_bad [B, n * C, Hv]`` as ``[B, Hk, G, n, C, 1]``."""
        return bad.reshape(B, n, C, Hk, G).transpose(0, 3, 4, 1, 2)[..., None]

    def tokens_first(x, dtype):
        """``[B, Hk, G, n, C, D]`` -> ``[B, n * C, Hk * G, D]`` in ``dtype``."""
        n, C, D = x.shape[3], x.shape[4], x.shape[5]
        return x.transpose(0, 3, 4, 1, 2, 5).reshape(B, n * C, Hk * x.shape[2], D).astype(dtype)

    def states(s):  # [B, Hv, Dv, Dk] <-> [B, Hk, G, Dv, Dk]
        return s.reshape(B, Hk, G, Dv, Dk)

    # The states entering groups 1..n-1 leave the forward stacked in about sqrt(n)
    # blocks of about sqrt(n) (as scan's saved carries): every output of a primitive
    # lists its siblings in MLX, so one output per group cost O(n^2) host time and
    # memory outside MLX's allocator (found by probing, session 52: at C = 1, Hv = 1,
    # Dk = Dv = 2, the forward at T = 8192 took 13.0 s and 2709 MiB RSS, 6.6 s and 657
    # MiB in blocks; docs/linear_attention.md). Not one stack of them all: in a first
    # derivative its cotangent is MLX's zeros of its whole size, materialized when
    # indexed, which would double the saved states in the backward; a block's is alive
    # only while its groups are processed (rule 2, in the backward below).
    blocks = sqrt_blocks(len(groups) - 1)
    block_ends = {hi - 1 for _, hi in blocks}  # index of the last saved state of a block

    def unstacked(stacked: mx.array, j: int) -> mx.array:
        """Entry ``j`` ``[B, Hv, Dv, Dk]`` of a stacked block (a slice, as scan's)."""
        return stacked[j : j + 1].reshape(B, Hv, Dv, Dk)

    @mx.custom_function
    def core(q, k, v, g, s0, o_bad):
        outs, saved, block = [], [], []
        state = states(s0)
        for gi, piece in enumerate(zip(*(slices_at(x, cuts, 1) for x in (q, k, v, g, o_bad)))):
            _, n, C = groups[gi]
            o, state = _forward_group(heads_first(*piece[:4], n, C), state, scale)
            o = tokens_first(mx.where(per_head_mask(piece[4], n, C), _NAN, o), out_dtype)
            # Rule 1: the state leaves the group only after the group's outputs exist.
            state = _ordering.carry_after_outputs([state], [o])[0]
            outs.append(o)
            if gi + 1 < len(groups):
                block.append(state.reshape(B, Hv, Dv, Dk))
            if gi in block_ends:
                saved.append(mx.stack(block))
                block = []
                # Rule 1 again: the stacked block is an output; the chain moves on only
                # once it exists, so the block's separate states are freed now rather
                # than all at the end of the forward.
                state = _ordering.carry_after_outputs([state], saved[-1:])[0]
        return [_join(outs), state.reshape(B, Hv, Dv, Dk), *saved]

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        q, k, v, g, s0, o_bad = primals
        ct_o, ct_final = cotangents[0], cotangents[1]
        saved = [
            unstacked(x, j) for x, (lo, hi) in zip(outputs[2:], blocks) for j in range(hi - lo)
        ]
        # The saved states are outputs too: a second derivative sends them cotangents,
        # which join the state's where it was saved. In a first derivative they are
        # MLX's zeros, one block of them alive while its groups are processed: each
        # block's waits for the cotangent flowing into its last group (rule 2). Without
        # that edge MLX materialized every block's zeros up front: growth 2.74 MiB in
        # test_backward_memory_is_one_group, eager, against 1.73 with it and 1.79 with one
        # output per group (session 52).
        ct_blocks = list(cotangents[2:])
        block_of = [b for b, (lo, hi) in enumerate(blocks) for _ in range(lo, hi)]
        d_state = states(ct_final.astype(F32))
        # Groups cut with split_at (a concatenate as its vjp): a second derivative
        # differentiates this backward, where a slice's vjp is a zero-padded buffer of
        # the whole sequence per group.
        pieces = [split_at(x, cuts, 1) if cuts else [x] for x in (q, k, v, g, ct_o)]
        bad_pieces = slices_at(o_bad, cuts, 1)
        grads: list[list[mx.array]] = [[] for _ in range(4)]
        for gi in reversed(range(len(groups))):
            _, n, C = groups[gi]
            if gi + 1 < len(groups):  # the state leaving the group was saved: its cotangent
                b = block_of[gi]
                lo, hi = blocks[b]
                if gi == hi - 1 and _WAIT_SAVED_COTANGENTS:
                    ct_blocks[b] = _ordering.recompute_after_cotangent([ct_blocks[b]], [d_state])[0]
                d_state = d_state + states(unstacked(ct_blocks[b], gi - lo).astype(F32))
            # Rule 2: recompute the group only once the cotangent flowing into it exists
            # (without it, a gradient of q alone ran every group's cotangent-free work
            # first, past what all five gradients keep; found by probing, session 51:
            # test_backward_memory_of_q_alone_is_within_all_fives).
            *xs, s_in = _ordering.recompute_after_cotangent(
                [*(p[gi] for p in pieces), s0 if gi == 0 else saved[gi - 1]], [d_state]
            )
            x = heads_first(*xs[:4], n, C)
            d_o = xs[4].astype(F32).reshape(B, n, C, Hk, G, Dv).transpose(0, 3, 4, 1, 2, 5)
            d_o = mx.where(per_head_mask(bad_pieces[gi], n, C), 0.0, d_o)  # NaN outputs
            s_in = states(s_in)
            d_q, d_k, d_v, d_g, d_state = _backward_group(x, s_in, d_o, d_state, scale)
            d_xs = [
                tokens_first(d_q, q.dtype),
                tokens_first(d_k, k.dtype),
                tokens_first(d_v, v.dtype),
                d_g.transpose(0, 3, 4, 1, 2).reshape(B, n * C, Hv).astype(g.dtype),
            ]
            # Rule 3: the cotangent leaves the group only after its input gradients.
            d_state = _ordering.cotangent_after_gradients([d_state], d_xs)[0]
            for parts, d in zip(grads, d_xs):
                parts.append(d)
        # Rule 4: one concatenate per input.
        d_inputs = [_join(parts[::-1]) for parts in grads]
        return d_inputs + [d_state.reshape(B, Hv, Dv, Dk), mx.zeros_like(o_bad)]

    return core


def _join(parts: list[mx.array]) -> mx.array:
    """The groups' pieces joined along the tokens (axis 1). Not the Gated DeltaNet op's
    ``_cat``, whose concatenation along axis 0 where ``B = 1`` (faster on CUDA) grew this
    op's backward peak in test_backward_memory_is_one_group from 1.7 to 4.8 MiB (CPU)."""
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def _decays(g: mx.array) -> SimpleNamespace:
    """A group's decays from its gates ``g`` ``[..., n, C]``, every one the ``exp`` of a
    sum of exactly the gates it spans: ``b`` (``g_1 + ... + g_i``), ``to_end``
    (``g_{j+1} + ... + g_C``), ``la`` (the chunk's sum ``[..., n]``) and ``D`` (``[...,
    n, C, C]``, ``exp(g_{j+1} + ... + g_i)`` for ``i >= j``, else 0)."""
    C = g.shape[-1]
    i = mx.arange(C)[:, None]
    j = mx.arange(C)[None, :]
    spans = mx.cumsum(mx.where(i > j, g[..., :, None], 0.0), axis=-2)
    return SimpleNamespace(
        b=mx.cumsum(g, axis=-1),
        to_end=mx.cumsum(g, axis=-1, reverse=True, inclusive=False),
        la=mx.sum(g, axis=-1),
        D=mx.exp(mx.where(i >= j, spans, -mx.inf)),
    )


def _chunk_products(la: mx.array, backward: bool) -> mx.array:
    """``[..., n, n]``: forward ``Lambda[c, m] = exp(la_m + ... + la_{c-1})`` for ``m <=
    c`` (an empty sum for ``m = c``: 1), the states entering the chunks from ``[S_in, W_0,
    ..., W_{n-2}]``; backward ``exp(la_{c+1} + ... + la_m)`` for ``m >= c``, the
    cotangents leaving the chunks from ``[R_1, ..., R_{n-1}, dS_out]``; else 0."""
    n = la.shape[-1]
    r = mx.arange(n)[:, None]
    m = mx.arange(n)[None, :]
    if backward:  # row c, column m: the sum of la_r over c < r <= m
        spans = mx.cumsum(mx.where(m > r, la[..., None, :], 0.0), axis=-1)
        return mx.exp(mx.where(m >= r, spans, -mx.inf))
    # row c, column m: the sum of la_r over m <= r < c (r down the rows, exclusive)
    spans = mx.cumsum(mx.where(r >= m, la[..., :, None], 0.0), axis=-2, inclusive=False)
    return mx.exp(mx.where(r >= m, spans, -mx.inf))


def _combine(weights: mx.array, xs: mx.array, backward: bool) -> mx.array:
    """``weights [..., n, n]`` (:func:`_chunk_products`) times the stacked ``xs [..., n,
    Dv, Dk]`` along the chunks. A non-finite ``xs[m]`` (an overflow, a NaN cotangent)
    reads as zero there and makes NaN of what it reaches (the rows ``c >= m`` forward,
    ``c <= m`` backward), not of the rest through the zeros of ``weights``."""
    shape = xs.shape
    flat = xs.reshape(tuple(shape[:-2]) + (shape[-2] * shape[-1],))
    bad = bad_rows(flat)  # [..., n]: a row holds a non-finite value
    out = weights @ mx.where(bad[..., None], 0.0, flat)
    reach = mx.cumsum(bad.astype(mx.int32), axis=-1, reverse=backward) > 0
    return mx.where(reach[..., None], _NAN, out).reshape(shape)


def _entering(d: SimpleNamespace, s_in: mx.array, w: mx.array) -> mx.array:
    """The states entering a group's chunks ``[..., n, Dv, Dk]`` from the one entering the
    group ``s_in [..., Dv, Dk]`` and the chunks' writes ``w [..., n, Dv, Dk]``."""
    xs = mx.concatenate([s_in[..., None, :, :], w[..., :-1, :, :]], axis=-3)
    return _combine(_chunk_products(d.la, backward=False), xs, backward=False)


def _writes(x: SimpleNamespace, d: SimpleNamespace) -> mx.array:
    """``W_c = sum_j exp(g_{j+1} + ... + g_C) v_j k_j^T`` per chunk ``[..., n, Dv, Dk]``."""
    return (x.v * mx.exp(d.to_end)[..., None]).swapaxes(-1, -2) @ x.k


def _forward_group(x: SimpleNamespace, s_in: mx.array, scale: float):
    """A group's outputs ``[B, Hk, G, n, C, Dv]`` and the state leaving it, given the
    state entering it ``[B, Hk, G, Dv, Dk]``."""
    d = _decays(x.g)
    w = _writes(x, d)
    s = _entering(d, s_in, w)
    scores = (x.q @ x.k.swapaxes(-1, -2)) * d.D
    o = scale * (scores @ x.v + mx.exp(d.b)[..., None] * (x.q @ s.swapaxes(-1, -2)))
    leaving = mx.exp(d.la[..., -1])[..., None, None] * s[..., -1, :, :] + w[..., -1, :, :]
    return o, leaving


def _backward_group(x: SimpleNamespace, s_in: mx.array, d_o: mx.array, d_out: mx.array, scale):
    """A group's input gradients (``dq``, ``dk`` ``[B, Hk, 1, n, C, Dk]``, ``dv``, ``dg``
    per value head) and the cotangent of the state entering it, given the cotangents of
    its outputs ``d_o`` and of the state leaving it ``d_out``."""
    d = _decays(x.g)
    s = _entering(d, s_in, _writes(x, d))  # the states entering the chunks, again
    e, f = mx.exp(d.b)[..., None], mx.exp(d.to_end)[..., None]  # [..., n, C, 1]
    r = scale * (d_o * e).swapaxes(-1, -2) @ x.q  # [..., n, Dv, Dk]
    # The cotangents of the states leaving the chunks: R of the chunks after, then d_out.
    ys = mx.concatenate([r[..., 1:, :, :], d_out[..., None, :, :]], axis=-3)
    d_s = _combine(_chunk_products(d.la, backward=True), ys, backward=True)
    d_in = mx.exp(d.la[..., 0])[..., None, None] * d_s[..., 0, :, :] + r[..., 0, :, :]

    qk = x.q @ x.k.swapaxes(-1, -2)  # [B, Hk, 1, n, C, C]
    d_scores = scale * (d_o @ x.v.swapaxes(-1, -2)) * d.D  # [B, Hk, G, n, C, C]
    d_q_state = scale * e * (d_o @ s)  # [..., n, C, Dk]
    d_k_state = f * (x.v @ d_s)
    d_q = (d_scores @ x.k + d_q_state).sum(axis=2, keepdims=True)
    d_k = (d_scores.swapaxes(-1, -2) @ x.q + d_k_state).sum(axis=2, keepdims=True)
    d_v = scale * ((qk * d.D).swapaxes(-1, -2) @ d_o) + f * (x.k @ d_s.swapaxes(-1, -2))
    # d g_l: the spans of D that hold g_l (rows i >= l, columns j < l), e_i for i >= l,
    # f_j for j < l, and the chunk's decay a.
    C = x.g.shape[-1]
    i = mx.arange(C)[:, None]
    l_ = mx.arange(C)[None, :]
    left = mx.cumsum(d_scores * qk, axis=-1, inclusive=False)  # [i, l]: sum over j < l
    d_g = mx.sum(mx.where(i >= l_, left, 0.0), axis=-2)
    d_g = d_g + mx.cumsum(mx.sum(x.q * d_q_state, axis=-1), axis=-1, reverse=True)
    d_g = d_g + mx.cumsum(mx.sum(x.k * d_k_state, axis=-1), axis=-1, inclusive=False)
    d_a = mx.sum(d_s * s, axis=(-2, -1)) * mx.exp(d.la)  # [..., n]
    d_g = d_g + d_a[..., None]
    return d_q, d_k, d_v, d_g, d_in
