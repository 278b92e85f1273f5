"""``gated_delta_rule``: the Gated DeltaNet recurrence in chunk form.

Forward: the intra-chunk work (the UT/WY transform, a unit lower triangular inverse
written with matrix products) is computed for many chunks at once, as batched products
(all chunks of a short sequence; groups of ~8 MiB intermediates for long ones, which
bounds forward memory); only the state pass runs chunk after chunk. Backward: one
``mx.custom_function`` over the whole sequence keeps the state entering every chunk
(``T / C`` states) and walks groups of chunks in reverse: the group's preparation is
recomputed batched, a short loop differentiates only the state step chunk by chunk,
and one ``mx.vjp`` of the preparation over the group gives its input gradients; the
ordering rules of :mod:`chunkscan._ordering` free one group's intermediates before the
next is recomputed. See ``docs/gated_delta.md`` for the math.
"""

from __future__ import annotations

import mlx.core as mx

from ... import _ordering, _tree
from ._checks import Spec, check_inputs, empty_result
from .naive import l2_normalize

F32 = mx.float32
_GROUP_BYTES = 8 << 20  # forward: chunks are prepared in groups of about this size
_SMALL = 8  # below this block size the triangular inverse uses elementwise products


def gated_delta_rule(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    *,
    scale: float | None = None,
    initial_state: mx.array | None = None,
    chunk_size: int = 64,
    normalize_qk: bool = False,
    cu_seqlens: list[int] | mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Gated DeltaNet over a whole sequence, chunkwise, with a bounded-memory backward.

    Per value head, with the state ``S`` of shape ``[Dv, Dk]``, values and gradients
    match, to float tolerance, this loop (:func:`naive_recurrent_gated_delta_rule`)::

        for t in range(T):
            S = exp(g[t]) * S
            S = S + beta[t] * (v[t] - S @ k[t]) k[t]^T
            o[t] = scale * S @ q[t]

    Value head ``h`` uses key head ``h // (Hv // Hk)``. Unlike the loop, the forward
    is a few large batched products plus ``T / chunk_size`` sequential state updates,
    and the backward keeps ``T / chunk_size`` states plus one chunk's recomputation.

    Args:
        q (array): Queries ``[B, T, Hk, Dk]``.
        k (array): Keys ``[B, T, Hk, Dk]``.
        v (array): Values ``[B, T, Hv, Dv]``, ``Hv`` a multiple of ``Hk``.
        g (array): Log-decay ``[B, T, Hv]`` (usually ``<= 0``; the state is multiplied
            by ``exp(g)``, so ``-inf`` resets it to zero and ``g > 0`` grows it, exact
            within float range; mlx-lm passes ``exp(g)``).
        beta (array): Update strength ``[B, T, Hv]``.
        scale (float, optional): Output scale. Default: ``Dk ** -0.5``.
        initial_state (array, optional): ``[B, Hv, Dv, Dk]`` (or ``[N, Hv, Dv, Dk]``
            with ``cu_seqlens``, one per sequence). Default: zeros.
        chunk_size (int, optional): Steps per chunk; a performance knob only (need not
            divide ``T``; larger than the longest sequence means one chunk).
            Default: ``64``.
        normalize_qk (bool, optional): L2-normalise ``q`` and ``k`` over ``Dk`` first
            (``x / sqrt(sum(x**2) + 1e-6)``, differentiated). Default: ``False``.
        cu_seqlens (list of int or array, optional): Packed sequences: offsets
            ``[0, t1, ..., T]`` of ``N`` sequences concatenated along ``T`` in one row
            (``B`` must be 1). The state restarts from ``initial_state[n]`` (or zeros)
            at each start. Static: read once, not traced. Default: ``None``.

    Returns:
        tuple: ``(o, final_state)``: ``o`` ``[B, T, Hv, Dv]`` in the dtype of ``q``;
        ``final_state`` ``[B, Hv, Dv, Dk]`` (``[N, Hv, Dv, Dk]`` with ``cu_seqlens``)
        in float32.

    Example:
        >>> o, s = chunkscan.gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    """
    spec = check_inputs(
        "gated_delta_rule", q, k, v, g, beta, scale, initial_state, chunk_size, cu_seqlens
    )
    empty = empty_result(spec, q, initial_state)
    if empty is not None:
        return empty
    out_dtype = q.dtype
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    plan = _Plan(spec)
    if initial_state is None:
        h0 = mx.zeros((spec.n_states, spec.Hk, spec.G, spec.Dv, spec.Dk), dtype=F32)
    else:
        h0 = initial_state.astype(F32).reshape(spec.n_states, spec.Hk, spec.G, spec.Dv, spec.Dk)
    chunked = [plan.to_chunks(x) for x in (q, k, v, g, beta)]
    outs = _tree.as_list(_make_core(spec, plan, out_dtype)(*chunked, h0))
    o = plan.from_chunks(outs[0])
    final = outs[1].reshape(spec.n_states, spec.Hv, spec.Dv, spec.Dk)
    return o, final


class _Plan:
    """How tokens map onto chunks; each packed sequence starts its own chunk.

    The padded tokens at the end of a sequence's last chunk have ``g = 0`` and
    ``beta = 0``: the state passes them unchanged and their outputs are dropped.
    """

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        lengths = [spec.T] if spec.seqs is None else [hi - lo for lo, hi in spec.seqs]
        C = min(spec.chunk_size, max(lengths))
        self.C = C
        self.starts: dict[int, int] = {}  # chunk index -> sequence that starts there
        self.ends: dict[int, int] = {}  # chunk index -> sequence that ends there
        if spec.seqs is None:
            self.N = -(-spec.T // C)
            self.starts[0] = 0
            self.ends[self.N - 1] = 0
            self.pad = self.N * C - spec.T
            return
        gather, scatter, c = [], [], 0
        for s, (lo, hi) in enumerate(spec.seqs):
            n_s = -(-(hi - lo) // C)
            self.starts[c] = s
            self.ends[c + n_s - 1] = s
            scatter.extend(range(c * C, c * C + hi - lo))
            gather.extend(range(lo, hi))
            gather.extend([spec.T] * (n_s * C - (hi - lo)))  # the appended zero token
            c += n_s
        self.N = c
        self.gather = mx.array(gather, dtype=mx.int32)
        self.scatter = mx.array(scatter, dtype=mx.int32)

    @property
    def packed(self) -> bool:
        return self.spec.seqs is not None

    def to_chunks(self, x: mx.array) -> mx.array:
        """``[B, T, ...]`` -> ``[B, N, C, ...]`` (zero padded)."""
        rest = tuple(x.shape[2:])
        if not self.packed:
            if self.pad:
                x = mx.pad(x, [(0, 0), (0, self.pad)] + [(0, 0)] * len(rest))
        else:
            x = mx.concatenate([x, mx.zeros((1, 1) + rest, dtype=x.dtype)], axis=1)
            x = mx.take(x, self.gather, axis=1)
        return x.reshape((x.shape[0], self.N, self.C) + rest)

    def from_chunks(self, o: mx.array) -> mx.array:
        """``[B, N, C, Hv, Dv]`` -> ``[B, T, Hv, Dv]``."""
        o = o.reshape((o.shape[0], self.N * self.C) + tuple(o.shape[3:]))
        if self.packed:
            return mx.take(o, self.scatter, axis=1)
        return o[:, : self.spec.T] if self.pad else o


def _make_core(spec: Spec, plan: _Plan, out_dtype: mx.Dtype):
    """The custom function ``(q, k, v, g, beta, h0) -> [o, final, *saved states]``.

    Inputs are in chunk layout ``[B, N, C, ...]``; ``h0`` is ``[n, Hk, G, Dv, Dk]``
    float32. ``saved`` are the states entering every chunk that does not start a
    sequence; they are outputs so that the backward pass can read them.
    """
    N, scale = plan.N, spec.scale

    def h0_for(h0: mx.array, s: int) -> mx.array:
        return h0[s : s + 1] if plan.packed else h0

    def prep_list(qg, kg, vg, gg, bg):
        """``_prepare`` of a group of chunks as a list in ``_KEYS`` order."""
        prep = _prepare(qg, kg, vg, gg, bg, scale)
        return [prep[key] for key in _KEYS]

    def step_fn(state, *prep_c):
        """One chunk's state step from its prepared slices: ``[o_chunk, state_out]``."""
        o_c, new_state = _state_step(state, dict(zip(_KEYS, prep_c)), 0)
        return [_to_output(o_c, out_dtype), new_state]

    group = _group_size(spec, plan)
    # The backward's groups are half as large: they also keep their prepared gradients.
    bwd_group = _group_size(spec, plan, _GROUP_BYTES // 2)

    @mx.custom_function
    def core(q, k, v, g, beta, h0):
        outs, finals, saved = [], {}, []
        state = h0
        for c in range(N):
            if c % group == 0:
                # Intra-chunk work for a group of chunks at once. Its inputs wait for
                # the state entering the group, so that groups are prepared one after
                # the other instead of all up front (bounded forward memory).
                xs = [x[:, c : c + group] for x in (q, k, v, g, beta)]
                xs = list(mx.depends(xs, [state])) if c > 0 else xs
                prep = _prepare(*xs, scale)
            if c in plan.starts:
                state = h0_for(h0, plan.starts[c])
            else:
                saved.append(state)
            o_c, state = _state_step(state, prep, c % group)
            o_c = _to_output(o_c, out_dtype)
            state = _ordering.carry_after_outputs([state], [o_c])[0]
            outs.append(o_c)
            if c in plan.ends:
                finals[plan.ends[c]] = state
        o = mx.concatenate(outs, axis=1) if N > 1 else outs[0]
        final = mx.concatenate([finals[s] for s in sorted(finals)], axis=0)
        return [o, final, *saved]

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        q, k, v, g, beta, h0 = _tree.as_list(primals)
        cts, outs = _tree.as_list(cotangents), _tree.as_list(outputs)
        ct_o, ct_final = cts[0], cts[1]
        saved = iter(outs[2:])
        entering = [
            h0_for(h0, plan.starts[c]) if c in plan.starts else next(saved) for c in range(N)
        ]
        grads: list[list[mx.array]] = [[] for _ in range(5)]
        d_h0: dict[int, mx.array] = {}
        d_state = None
        chain: list[mx.array] = [ct_final]  # the last state cotangent, to order the groups
        for g0 in reversed(range(0, N, bwd_group)):
            g1 = min(N, g0 + bwd_group)
            # The group's state-independent work, for all its chunks at once, once the
            # cotangent entering the group exists (rule 2).
            xs = [x[:, g0:g1] for x in (q, k, v, g, beta)]
            xs = _ordering.recompute_after_cotangent(xs, chain)
            prep = prep_list(*xs)
            d_prep: list[list[mx.array]] = [[] for _ in _KEYS]
            for c in reversed(range(g0, g1)):
                if c in plan.ends:
                    s = plan.ends[c]
                    d_state = ct_final[s : s + 1] if plan.packed else ct_final
                i = c - g0
                prep_c = [
                    x[:, :, i : i + 1] if j < 2 else x[:, :, :, i : i + 1]
                    for j, x in enumerate(prep)
                ]
                state_in = _ordering.recompute_after_cotangent([entering[c]], [d_state])
                _, d = mx.vjp(step_fn, state_in + prep_c, [ct_o[:, c : c + 1], d_state])
                d_state = _ordering.cotangent_after_gradients([d[0]], list(d[1:]))[0]
                for j in range(len(_KEYS)):
                    d_prep[j].append(d[1 + j])
                if c in plan.starts:
                    d_h0[plan.starts[c]] = d_state
            d_prep_g = [_cat(parts[::-1], 2 if j < 2 else 3) for j, parts in enumerate(d_prep)]
            _, d_xs = mx.vjp(prep_list, xs, d_prep_g)
            # The cotangent leaves the group only after the group's input gradients.
            d_state = _ordering.cotangent_after_gradients([d_state], list(d_xs))[0]
            chain = [d_state]
            for j in range(5):
                grads[j].append(d_xs[j])
        d_inputs = [_cat(parts[::-1], 1) for parts in grads]
        d_h0_all = mx.concatenate([d_h0[s] for s in sorted(d_h0)], axis=0)
        return d_inputs + [d_h0_all]

    return core


_KEYS = ("q", "k", "w", "u", "p", "gamma", "to_end", "decay")  # q, k: chunk axis 2


def _cat(parts: list[mx.array], axis: int) -> mx.array:
    return mx.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]


def _group_size(spec: Spec, plan: _Plan, budget: int | None = None) -> int:
    """Chunks prepared together: their largest intermediate stays near ``budget`` bytes
    (default ``_GROUP_BYTES``)."""
    per_chunk = 4 * spec.B * spec.Hv * plan.C * max(spec.Dk, spec.Dv, plan.C)
    budget = _GROUP_BYTES if budget is None else budget
    return max(1, min(plan.N, budget // per_chunk))


def _prepare(q, k, v, g, beta, scale: float) -> dict[str, mx.array]:
    """Everything that does not depend on the state, for ``n`` chunks at once.

    Inputs ``[B, n, C, H, D]`` / ``[B, n, C, Hv]``. Shapes returned (``G = Hv // Hk``):
    ``q``, ``k``: ``[B, Hk, n, C, Dk]``; ``w``: ``[B, Hk, G, n, C, Dk]``; ``u``:
    ``[B, Hk, G, n, C, Dv]``; ``p``: ``[B, Hk, G, n, C, C]``; ``gamma``, ``to_end``:
    ``[B, Hk, G, n, C]``; ``decay``: ``[B, Hk, G, n, 1]``.
    """
    B, n, C, Hk, _ = q.shape
    Hv, Dv = v.shape[-2:]
    G = Hv // Hk
    qf = q.astype(F32).transpose(0, 3, 1, 2, 4)
    kf = k.astype(F32).transpose(0, 3, 1, 2, 4)
    vf = v.astype(F32).reshape(B, n, C, Hk, G, Dv).transpose(0, 3, 4, 1, 2, 5)
    gf = g.astype(F32).reshape(B, n, C, Hk, G).transpose(0, 3, 4, 1, 2)
    bf = beta.astype(F32).reshape(B, n, C, Hk, G).transpose(0, 3, 4, 1, 2)

    # Log-decays relative to the chunk, each a sum of exactly the gates it spans (no
    # difference of two cumulative sums): no cancellation after a very negative gate,
    # and g = -inf (a hard reset) gives zero decays rather than NaN.
    gcum = mx.cumsum(gf, axis=-1)  # from the chunk start through step i
    to_end = mx.cumsum(gf, axis=-1, reverse=True, inclusive=False)  # after step j
    glast = gcum[..., -1:]
    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    strict_g = mx.where(strict, gf[..., :, None], 0.0)  # [i, j] = g_i for i > j
    rel = mx.cumsum(strict_g, axis=-2)  # [i, j] = g_{j+1} + ... + g_i
    decays = mx.exp(mx.where(causal, rel, -mx.inf))  # gamma_i / gamma_j, zero above

    kt = kf.swapaxes(-1, -2)
    kk = mx.expand_dims(kf @ kt, 2)  # [B, Hk, 1, n, C, C]
    qk = mx.expand_dims(qf @ kt, 2)
    lower = mx.where(strict, bf[..., :, None] * decays * kk, 0.0)
    a = unit_lower_inverse(lower)  # (I + lower)^-1
    gamma = mx.exp(gcum)
    w = a @ (mx.expand_dims(kf, 2) * (bf * gamma)[..., None])
    u = a @ (vf * bf[..., None])
    return {
        "q": qf * scale,
        "k": kf,
        "w": w,
        "u": u,
        "p": (scale * qk) * decays,
        "gamma": gamma,
        "to_end": mx.exp(to_end),
        "decay": mx.exp(glast),
    }


def _state_step(state: mx.array, prep: dict[str, mx.array], c: int):
    """Chunk ``c``: ``(o [B, Hk, G, C, Dv], state_out [B, Hk, G, Dv, Dk])``."""
    st = state.swapaxes(-1, -2)  # [B, Hk, G, Dk, Dv]
    q_c = mx.expand_dims(prep["q"][:, :, c], 2)
    k_c = mx.expand_dims(prep["k"][:, :, c], 2)
    v_new = prep["u"][:, :, :, c] - prep["w"][:, :, :, c] @ st
    o = (q_c @ st) * prep["gamma"][:, :, :, c][..., None] + prep["p"][:, :, :, c] @ v_new
    scaled = v_new * prep["to_end"][:, :, :, c][..., None]
    new_state = prep["decay"][:, :, :, c][..., None] * state + scaled.swapaxes(-1, -2) @ k_c
    return o, new_state


def _to_output(o: mx.array, dtype: mx.Dtype) -> mx.array:
    """``[B, Hk, G, C, Dv]`` -> ``[B, 1, C, Hv, Dv]`` in ``dtype``."""
    B, Hk, G, C, Dv = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(B, 1, C, Hk * G, Dv).astype(dtype)


@mx.custom_function
def unit_lower_inverse(lower: mx.array) -> mx.array:
    """``(I + lower)^-1`` for strictly lower triangular ``lower`` ``[..., n, n]``.

    Recursive 2x2 block inversion, all blocks of one size at once:
    ``[[X11, 0], [-X22 L21 X11, X22]]``. Products only, so it runs on every backend.
    """
    n = lower.shape[-1]
    size = 1 << (n - 1).bit_length()
    batch = tuple(lower.shape[:-2])
    if size != n:
        lower = mx.pad(lower, [(0, 0)] * len(batch) + [(0, size - n), (0, size - n)])
    off_diagonal = []
    blocks = mx.expand_dims(lower, -3)  # [..., 1, size, size]
    b = size
    while b > 1:
        h = b // 2
        off_diagonal.append(blocks[..., h:, :h])
        blocks = mx.stack([blocks[..., :h, :h], blocks[..., h:, h:]], axis=-3)
        blocks = blocks.reshape(batch + (-1, h, h))
        b = h
    x = mx.ones(batch + (size, 1, 1), dtype=lower.dtype)
    for l21 in reversed(off_diagonal):
        p, h = l21.shape[-3], l21.shape[-1]
        x = x.reshape(batch + (p, 2, h, h))
        x11, x22 = x[..., 0, :, :], x[..., 1, :, :]
        x21 = -_mm(x22, _mm(l21, x11))
        top = mx.concatenate([x11, mx.zeros_like(x11)], axis=-1)
        bottom = mx.concatenate([x21, x22], axis=-1)
        x = mx.concatenate([top, bottom], axis=-2)
    x = x.reshape(batch + (size, size))
    return x[..., :n, :n] if size != n else x


@unit_lower_inverse.vjp
def _unit_lower_inverse_vjp(primals, cotangent, output):
    x = _tree.as_list(output)[0]
    ct = _tree.as_list(cotangent)[0]
    xt = x.swapaxes(-1, -2)
    return -(xt @ (ct @ xt))


def _mm(a: mx.array, b: mx.array) -> mx.array:
    """Matrix product; small blocks as broadcast products (BLAS calls cost more)."""
    if a.shape[-1] < _SMALL:
        return mx.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)
    return a @ b
