"""``attention``: softmax attention in query blocks with an O(T) memory backward.

One ``mx.custom_function`` over the whole call. The queries are cut into blocks of
rows; each block attends to the keys it needs (with ``mask="causal"``, the prefix up
to the block's last visible key: blocks above the diagonal are never computed) with a
full-row softmax in float32, so no running maximum is needed. The forward keeps only
the output ``o``. The backward recomputes block by block (the FlashAttention-2
backward): ``p`` from the scores, ``delta = sum_j p_j dp_j`` (a block holds its rows'
every key; FlashAttention's ``rowsum(do * o)`` lost ``dq`` to rounding in low
precision), ``ds = p * (dp - delta)``; ``dq`` of a block is complete at once, ``dk``
and ``dv`` accumulate in float32 over the blocks. The ordering rules of
:mod:`chunkscan._ordering` finish, and free, one block's scratch before the next block
starts.

Grouped heads: ``q`` is viewed as ``[B, Hkv, G, T, D]`` and a block's ``G`` heads are
stacked as rows of one matrix product against the shared key/value head, so ``k`` and
``v`` are never repeated in memory.

Memory: the inputs, ``o``, the gradients, two float32 accumulators ``[B, Hkv, S, D]``
plus one block's scratch. A block has as many rows as keep its float32 scores within
:func:`scratch_bytes` (at most :data:`MAX_ROWS`), so the scratch does not grow with
``T`` (until a block is down to :data:`MIN_ROWS` rows).
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx

from ... import _backend, _ordering, _tree
from ..._backend import check_kernels, use_kernels
from .._cpu_threads import matmul, threads
from . import _cuda
from ._checks import Spec, check_inputs, empty_result
from .naive import mask_5d

F32 = mx.float32

#: Float32 scores of one block at most this many bytes (the scratch is a few times it);
#: ``None``: per device, :data:`CPU_SCRATCH_BYTES` on the CPU, :data:`GPU_SCRATCH_BYTES`
#: elsewhere (:func:`scratch_bytes`). An int applies on every device.
SCRATCH_BYTES: int | None = None
#: The CPU's: there smaller blocks were faster as well as smaller (1 MiB against 32 at
#: T = 2048 / 4096 / 8192, Hq = 2, D = 64: 0.62x / 0.70x / 0.83x the time, a ninth to a
#: sixteenth of the peak; docs/attention.md, "Knobs").
CPU_SCRATCH_BYTES = 1 << 20
#: A GPU's (as before session 47; the H100 / H200 run the CUDA kernels instead of the
#: blocks; Apple GPUs unmeasured).
GPU_SCRATCH_BYTES = 32 << 20
#: Rows per block at most (the automatic size) ...
MAX_ROWS = 1024
#: ... and at least (below this, per-op overheads dominate; memory grows again).
MIN_ROWS = 16
#: Calls with ``T * S`` at most this (per batch row and head) and a mask MLX treats as
#: we do (None, or "causal" with ``T <= S``) go to ``mx.fast.scaled_dot_product_attention``
#: (bfloat16 / float16 ones on a GPU, on their float32 upcast, :func:`_fast`): there its
#: backward's ``T x S`` scores are small, and it takes ``mx.vmap`` and ``mx.jvp``, which
#: the blocked form does not. Speed: on the GPU MLX's kernels are faster at every
#: length; on the CPU one block was up to 1.14x slower than MLX (it
#: recomputes the scores), but with the CPU's 1 MiB blocks the blocked form was faster
#: from T = 512 (0.63x at 1024; Hq=2, D=64, f32, ``bench/attention.py
#: --fast-max-scores 0``, docs/attention.md, "Short sequences"). 0 disables the shortcut.
FAST_MAX_SCORES = 1024 * 1024
#: Forward through MLX's fused kernel (``force_fused=True``) where one exists (GPU),
#: for None and causal (``T <= S``) masks: "auto" tries it (the CPU backend has none and
#: says so at once), "never" always runs the blocked forward.
FUSED_FORWARD = "auto"


@_backend.reads_settings_once
def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | mx.array | None = None,
    chunk_size: int | None = None,
    kernels: bool | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """Drop-in for ``mx.fast.scaled_dot_product_attention`` in training.

    Values and gradients (``dq``, ``dk``, ``dv``) match, to float tolerance,
    :func:`naive_attention`::

        s = scale * q @ k^T, plus the mask       # per query head h, key head h // G
        o = softmax(s) @ v

    Unlike it (and unlike MLX's backward, which keeps the ``T x S`` scores), backward
    memory is the inputs, outputs and gradients plus one block's scratch, not
    ``O(T * S)``. Works eagerly, under ``mx.compile`` and ``nn.value_and_grad``;
    under ``mx.vmap`` and ``mx.jvp`` only where the call goes to ``mx.fast`` (at most
    ``FAST_MAX_SCORES`` scores per head, no mask or a causal one; a bfloat16 / float16
    call on a GPU on its float32 upcast, as MLX's attention rounds the scores to the
    input dtype, and on the CPU not at all),
    or for the values only where it is one block:
    the blocked form's ordering edges (between blocks, and in its backward) have
    neither in MLX ("Not implemented for Depends"). Not under
    ``mx.compile(..., shapeless=True)``: the blocked form raises ("cannot infer output
    shapes"), and a call that goes to ``mx.fast`` takes its behaviour there, which with
    ``mask="causal"`` is wrong at a new length in MLX 0.32.4 (values, or the traced
    call's shape; ``mx.fast`` alone does the same).

    Args:
        q (array): Queries ``[B, Hq, T, D]``.
        k (array): Keys ``[B, Hkv, S, D]``, ``Hq`` a multiple of ``Hkv``.
        v (array): Values ``[B, Hkv, S, Dv]``.
        scale (float): Score scale, typically ``D ** -0.5``.
        mask (str or array, optional): ``None``; ``"causal"`` (query ``i`` sees keys
            ``j <= i + S - T``: the last query aligns with the last key, as in MLX);
            or an array broadcastable to ``[B, Hq, T, S]``, boolean (``True`` =
            attend) or floating (added to the scores). An array mask is a constant:
            it gets no gradient, unlike in ``mx.fast.scaled_dot_product_attention``;
            a floating mask computed from trainable weights would lose its share of
            the gradient (the mlx-lm seam sends such calls to MLX). Default: ``None``.
        chunk_size (int, optional): Query rows per block; ``None`` picks as many as
            keep one block's float32 scores within :func:`scratch_bytes`. A
            performance knob only. Default: ``None``.
        kernels (bool, optional): On a CUDA device the forward and the backward are
            fused kernels (:mod:`chunkscan.ops.attention._cuda`: tensor cores, no
            scratch) for bfloat16 inputs, head sizes 64, 128, 192 or 256 and no mask
            or ``"causal"`` with ``T <= S``; other calls, ``kernels=False`` and the
            environment variable ``CHUNKSCAN_CUDA_KERNELS=0`` use the blocked ops.
            ``True``: the kernels where they apply whatever that variable says (on a
            machine without a CUDA GPU, none: the blocked ops, no error). Calls below
            :data:`FAST_MAX_SCORES` go to ``mx.fast`` whatever this says (set it to 0
            for the kernels at every length). Default: ``None`` (automatic).
        stream (Stream or Device, optional): Where the call runs, as in ``mx.fast``
            (the whole call under ``mx.stream(stream)``: its choice of kernels and
            block size follow that device). Default: ``None`` (the default stream).

    Returns:
        array: ``[B, Hq, T, Dv]`` in the dtype of ``q``. A query row that sees no key
        (a fully masked row; with ``"causal"`` and ``T > S`` the first ``T - S`` rows)
        gives zeros, and zero gradients. (MLX returns the mean of ``v`` there for
        boolean masks and NaN for additive ``-inf`` masks.) With ``B``, ``T`` or
        ``S`` zero the result is zeros of that shape, as from ``mx.fast``.

    The scores are a float32 product of the upcast ``q`` and ``k`` (exact for bfloat16
    and float16 inputs), scaled in float32, for a float32 softmax and its statistics;
    the other matrix products run in the input dtype (tensor cores for bfloat16; but in
    float16 the products of the probabilities and of their gradient, for ``o``, ``dv``,
    ``dq`` and ``dk``, take float32 operands, for float16's range), and
    ``dk``/``dv`` accumulate in float32 (a short call on a GPU that goes to ``mx.fast``
    on the float32 upcast runs all of them in float32).

    Example:
        >>> o = chunkscan.attention(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal")
    """
    if stream is not None:  # (mx.fast's argument; it was refused, found by probing)
        try:
            where = mx.stream(stream)
        except TypeError as e:
            raise TypeError(
                f"[attention] stream must be an mx.Stream or an mx.Device, as in mx.fast "
                f"(mx.cpu, mx.new_stream(mx.gpu)), but got {type(stream).__name__}."
            ) from e
        with where:
            return attention(
                q, k, v, scale=scale, mask=mask, chunk_size=chunk_size, kernels=kernels
            )
    spec = check_inputs("attention", q, k, v, scale, mask, chunk_size)
    check_kernels("attention", kernels)
    # Read, and so check, the settings of the blocked path before the shortcut: a bad
    # CHUNKSCAN_CUDA_KERNELS or CHUNKSCAN_CPU_THREADS raised only once calls grew past
    # FAST_MAX_SCORES (found by probing; gated_delta_rule raises at every size).
    use_kernels(kernels, "attention")
    threads()
    _check_knobs()
    if (empty := empty_result(spec, q)) is not None:
        return empty
    if _use_fast(spec, q.dtype):
        return _fast(q, k, v, spec.scale, mask)
    return _blocked(spec, q, k, v, mask, kernels)


def blocked_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | mx.array | None = None,
    chunk_size: int | None = None,
    kernels: bool | None = None,
) -> mx.array:
    """:func:`attention` without the shortcut to MLX for short calls (tests, probes)."""
    spec = check_inputs("attention", q, k, v, scale, mask, chunk_size)
    _check_knobs()  # an empty call too (review)
    if (empty := empty_result(spec, q)) is not None:
        return empty
    return _blocked(spec, q, k, v, mask, kernels)


def _blocked(
    spec: Spec, q: mx.array, k: mx.array, v: mx.array, mask: object, kernels: bool | None
) -> mx.array:
    mask_arr = None
    if spec.mask_kind in ("bool", "additive"):
        mask_arr = mask_5d(mx.stop_gradient(mask), spec)
    cuda = uses_cuda_kernels(spec, q.dtype, kernels)
    masks = [] if mask_arr is None else [mask_arr]
    core = _make_core(spec, plan_blocks(spec), cuda, _backend.settings_in_effect())
    return _tree.as_list(core(q, k, v, *masks))[0]


def uses_cuda_kernels(spec: Spec, dtype: mx.Dtype, kernels: bool | None) -> bool:
    """Whether a call (past the shortcut to MLX) runs the CUDA kernels of :mod:`._cuda`."""
    return use_kernels(kernels, "attention") and _cuda.supports(spec, dtype)


def _check_knobs() -> None:
    """The module's knobs hold what they mean, checked by every call, the short ones
    too: ``FUSED_FORWARD`` is ``"auto"`` or ``"never"`` (``"always"`` or ``"Auto"`` read
    as ``"never"``; found by probing), the sizes are whole numbers (``SCRATCH_BYTES =
    "1MB"`` passed the short calls and failed in :func:`plan_blocks` with a bare
    ``TypeError``, ``FAST_MAX_SCORES = None`` everywhere; found by probing, session 49)."""
    if FUSED_FORWARD not in ("auto", "never"):
        raise ValueError(
            f"chunkscan.ops.attention.blocked.FUSED_FORWARD must be 'auto' or 'never' but "
            f"is {FUSED_FORWARD!r}. Set it to one of those."
        )
    least = {"FAST_MAX_SCORES": 0, "CPU_SCRATCH_BYTES": 1, "GPU_SCRATCH_BYTES": 1,
             "MAX_ROWS": 1, "MIN_ROWS": 0, "SCRATCH_BYTES": 1}  # fmt: skip
    for name, low in least.items():
        value = globals()[name]
        if name == "SCRATCH_BYTES" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            none = " or None (per device)" if name == "SCRATCH_BYTES" else ""
            raise ValueError(
                f"chunkscan.ops.attention.blocked.{name} must be an int >= {low}{none} but "
                f"is {value!r}. Set it to such a number (its default: docs/attention.md, "
                f'"Knobs").'
            )


def _use_fast(spec: Spec, dtype: mx.Dtype) -> bool:
    """Whether the call goes to ``mx.fast`` (:func:`_fast`): a short call with no mask
    or a causal one (``T <= S``); in bfloat16 / float16 not on the CPU, where the
    blocked form, faster than ``mx.fast`` from T = 512 in float32 already, keeps float32
    scores in its 1 MiB blocks (the float32 upcast was slower there and several times
    larger: review, session 49)."""
    simple = spec.mask_kind == "none" or (spec.mask_kind == "causal" and spec.T <= spec.S)
    if not (simple and spec.T * spec.S <= FAST_MAX_SCORES):
        return False
    return dtype == F32 or mx.default_device() != mx.cpu


def _fast(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: str | None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``, a bfloat16 / float16 call (on a GPU:
    :func:`_use_fast`) on its float32 upcast, the output rounded back: MLX's attention
    rounds the scores to the input dtype (on CUDA in its backward), and at scores of a
    few hundred units its bfloat16 ``dq`` was off by 35% of its largest value (run 127
    on an H100, session 49; the CUDA kernels and the blocked form: under 1%; on the CPU
    the outputs 11%, ``dk`` 50%, and float16 scores past 65504 gave NaN outputs, found by
    probing). On the upcast they keep ``mx.fast``'s transforms (``mx.vmap``, ``mx.jvp``:
    tested on an H100, run 128), which the CUDA kernels lack, at about its speed on these
    lengths (docs/attention.md, "Short sequences")."""
    if q.dtype == F32:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    up = [x.astype(F32) for x in (q, k, v)]
    return mx.fast.scaled_dot_product_attention(*up, scale=scale, mask=mask).astype(q.dtype)


def scratch_bytes() -> int:
    """The float32 scores one block may hold: :data:`SCRATCH_BYTES` where set, else the
    default device's (:data:`CPU_SCRATCH_BYTES` on the CPU, :data:`GPU_SCRATCH_BYTES`
    on a GPU)."""
    if SCRATCH_BYTES is not None:
        return SCRATCH_BYTES
    return CPU_SCRATCH_BYTES if mx.default_device() == mx.cpu else GPU_SCRATCH_BYTES


def plan_blocks(spec: Spec) -> list[tuple[int, int, int]]:
    """The query blocks ``(t0, t1, kend)``: rows ``[t0, t1)`` attend keys ``[0, kend)``.

    With ``"causal"`` and ``T > S`` the first ``T - S`` rows see no key and are in no
    block. Automatic sizes: the most rows (a multiple of 16, within
    ``[MIN_ROWS, MAX_ROWS]``) whose float32 scores fit :func:`scratch_bytes`. Checks
    the knobs it reads (a bare ``TypeError`` for ``SCRATCH_BYTES = "1MB"``; review).
    """
    _check_knobs()
    T, S = spec.T, spec.S
    causal = spec.mask_kind == "causal"
    off = S - T
    per = 4 * spec.B * spec.Hq  # bytes per (row, key) of float32 scores
    budget = max(1, scratch_bytes() // per)  # (row, key) pairs per block

    def kend(t1: int) -> int:
        return min(S, t1 + off) if causal else S

    t = max(0, -off) if causal else 0
    blocks = []
    while t < T:
        if spec.chunk_size is not None:
            r = spec.chunk_size
        else:
            if causal:  # largest r with r * (t + r + off) <= budget
                c = t + off
                r = int((-c + math.sqrt(c * c + 4.0 * budget)) / 2)
            else:
                r = budget // S
            r = max(1, MIN_ROWS, min(MAX_ROWS, r // 16 * 16 if r >= 16 else r))
        t1 = min(T, t + r)
        blocks.append((t, t1, kend(t1)))
        t = t1
    return blocks


def _make_core(
    spec: Spec, blocks: list[tuple[int, int, int]], cuda: bool = False, settings: dict | None = None
):
    """The custom function ``(q, k, v[, mask]) -> [o]`` and its blockwise vjp.

    ``mask``, given for an array mask only (not for None or "causal"), is that mask as
    ``[B|1, Hkv|1, G|1, T|1, S|1]``: an input of the custom function, with a zero
    cotangent (a broadcast scalar, no buffer). It was captured by the closure, and
    under ``mx.vmap`` with a batched mask the capture was vmap's placeholder ("[eval]
    Attempting to eval an array without a primitive", found by probing). ``cuda``: the vjp is
    the kernels of :mod:`._cuda`, forward and backward (the caller checked
    :func:`._cuda.supports`). ``settings``: what the forward's call read, which the vjp
    takes as read (:func:`chunkscan._backend.settings_read_once`).
    """
    B, Hkv, G, T, D, Dv = spec.B, spec.Hkv, spec.G, spec.T, spec.D, spec.Dv
    scale = spec.scale
    empty_rows = blocks[0][0]  # causal, T > S: rows that see no key

    def rows_of(x: mx.array, t0: int, t1: int) -> mx.array:
        """``[B, Hkv, G, T, d]`` -> block rows ``[B, Hkv, G * r, d]`` (G heads stacked)."""
        return x[:, :, :, t0:t1].reshape(B, Hkv, G * (t1 - t0), x.shape[-1])

    def probs(
        rows: mx.array, kp: mx.array, blk: tuple[int, int, int], mask: mx.array | None
    ) -> mx.array:
        """Float32 softmax ``[B, Hkv, G, r, kend]`` of a block, from its query rows
        ``[B, Hkv, G * r, D]`` (unscaled) and keys. The scores are a float32 product of
        the float32 operands (exact from bfloat16 / float16), scaled in float32: in
        the input dtype each score was rounded as it left its product (and q by its
        scale), so a bfloat16 score of a few hundred units was off by units, and a
        peaked softmax's gradients by far more than the CUDA kernels', whose scores stay
        float32 (dq 3.4 where the true dq is at most 9.5, against the kernels' 0.13;
        `bench/attention_peaked.py`; session 39)."""
        t0, t1, kend = blk
        s = matmul(rows.astype(F32), kp.astype(F32).swapaxes(-1, -2)) * scale
        s = s.reshape(B, Hkv, G, t1 - t0, kend)
        if spec.mask_kind == "causal":
            # Every row in a block sees key 0 (t0 >= T - S): no fully masked row.
            cols = mx.arange(kend)[None, :]
            visible = cols <= mx.arange(t0 + spec.S - T, t1 + spec.S - T)[:, None]
            return mx.softmax(mx.where(visible, s, -mx.inf), axis=-1)
        if mask is None:
            return mx.softmax(s, axis=-1)
        m = mask
        if m.shape[3] != 1:
            m = m[:, :, :, t0:t1]
        if m.shape[4] != 1:
            m = m[..., :kend]
        if spec.mask_kind == "bool":
            s = mx.where(m, s, -mx.inf)
        else:
            s = s + m.astype(F32)
        # A masked key's score is -inf, never a finite stand-in: with the scores clamped
        # to float32's lowest value, keys masked by -inf tied with keys masked by that
        # value (Hugging Face's padding mask) and took weight where no key was visible
        # (found by probing). A row that sees no key (all -inf) softmaxes zeros and is
        # zeroed, as naive_attention gives; a NaN score keeps its row NaN, as in MLX.
        seen = mx.any(s != -mx.inf, axis=-1, keepdims=True)
        return mx.softmax(mx.where(seen, s, 0.0), axis=-1) * seen

    def fused_forward(q, k, v):
        if FUSED_FORWARD == "never":
            return None
        if not (spec.mask_kind == "none" or (spec.mask_kind == "causal" and empty_rows == 0)):
            return None
        m = "causal" if spec.mask_kind == "causal" else None
        try:
            return mx.fast.scaled_dot_product_attention(
                q, k, v, scale=scale, mask=m, force_fused=True
            )
        except (ValueError, RuntimeError):  # no fused kernel here (e.g. CPU): blocked
            return None

    @mx.custom_function
    def core(q, k, v, *masks):
        mask = masks[0] if masks else None
        if cuda:
            return [_cuda.forward(spec, q, k, v)]
        fused = fused_forward(q, k, v)
        if fused is not None:
            return [fused]
        dtype = q.dtype
        qg = q.reshape(B, Hkv, G, T, D)
        outs = []
        prev: list[mx.array] = []
        for blk in blocks:
            t0, t1, kend = blk
            # The block's inputs wait for the previous block's output, so that blocks
            # run (and free their scratch) one after the other, not level by level.
            qb = _ordering.carry_after_outputs([qg[:, :, :, t0:t1]], prev)[0]
            p = probs(qb.reshape(B, Hkv, G * (t1 - t0), D), k[:, :, :kend], blk, mask)
            pp, vp = _operands(dtype, p.reshape(B, Hkv, G * (t1 - t0), kend), v[:, :, :kend])
            o_b = matmul(pp, vp).astype(dtype).reshape(B, Hkv, G, t1 - t0, Dv)
            outs.append(o_b)
            prev = [o_b]
        if empty_rows:
            outs.insert(0, mx.zeros((B, Hkv, G, empty_rows, Dv), dtype=dtype))
        o = mx.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
        return [o.reshape(B, spec.Hq, T, Dv)]

    @core.vjp
    @_backend.reads_settings_of(settings)
    def core_vjp(primals, cotangents, outputs):
        q, k, v, *masks = _tree.as_list(primals)
        mask = masks[0] if masks else None
        # The mask is a constant: a zero cotangent, broadcast from a scalar (no buffer).
        d_masks = [mx.broadcast_to(mx.zeros((), m.dtype), m.shape) for m in masks]
        do = _tree.as_list(cotangents)[0]
        o = _tree.as_list(outputs)[0]
        if cuda:
            return list(_cuda.backward(spec, q, k, v, o, do)) + d_masks
        dtype = q.dtype
        qg = q.reshape(B, Hkv, G, T, D)
        dog = do.astype(dtype).reshape(B, Hkv, G, T, Dv)
        dk = dv = None
        dqs = []
        # Last block first: it sees every key, so it starts the accumulators.
        for blk in reversed(blocks):
            t0, t1, kend = blk
            r = t1 - t0
            ins = [qg[:, :, :, t0:t1], dog[:, :, :, t0:t1]]
            # Rule 2: recompute this block only after the previous one's gradients (the
            # first one after the cotangent: a Depends keeps mx.compile from merging its
            # recomputation with the forward's, which would keep the forward's scratch).
            ins = _ordering.recompute_after_cotangent(ins, [do] if dk is None else [dk, dv])
            qb, dob = ins
            rows = qb.reshape(B, Hkv, G * r, D)
            dor = dob.reshape(B, Hkv, G * r, Dv)
            kp, vp = k[:, :, :kend], v[:, :, :kend]
            p = probs(rows, kp, blk, mask)
            dp = matmul(dor, vp.swapaxes(-1, -2)).reshape(B, Hkv, G, r, kend)
            # ds zero where p is (and no p dp in delta there): a masked key's dp (a
            # product in the input dtype) can overflow float16 to inf, and 0 * inf
            # made the row's dq NaN in blocks that hold masked keys only (found by
            # probing: NaN with one block, finite with blocks of 16, for the same
            # call). A NaN probability (from a NaN in q, k or the mask) keeps its NaN,
            # as in MLX: ``p > 0`` alone turned it into a finite zero gradient (found by
            # probing: dk all zeros for a NaN in k, with one block).
            # delta = sum_j p_j dp_j, from the same rounded dp: ds then
            # cancels as the softmax's own vjp does. With delta = rowsum(do * o) (o and
            # dp each rounded to the input dtype on their own) a peaked softmax's
            # dp - delta was their rounding: in bfloat16 dq off by 0.32 where mx.fast's
            # was 0.023 (found by probing; test_a_peaked_softmax_keeps_dq_as_mx_fast_does).
            # The scale goes into ds in float32: ds k and ds^T q are dq and dk themselves.
            # dq was (ds k) * scale, its product rounded to the input dtype unscaled: in
            # float16 every |dq| above 65504 * scale came out inf (most of float16's
            # range at D = 128; found by probing, session 52). In float16 the products
            # of ds (and of p: _operands) take float32 operands: ds rounded to float16
            # after the scale fell into float16's subnormals where the attention is
            # diffuse over long rows (S = 4096, small cotangents: dq 10x further off;
            # found by review, the same session).
            ds = _scores_gradient(p, dp, scale).reshape(B, Hkv, G * r, kend)
            ds, kp_in, rows_in = _operands(dtype, ds, kp, rows)
            dq_b = matmul(ds, kp_in).astype(dtype).reshape(B, Hkv, G, r, D)
            dk_b = matmul(ds.swapaxes(-1, -2), rows_in)
            pp, dor_in = _operands(dtype, p.reshape(B, Hkv, G * r, kend), dor)
            dv_b = matmul(pp.swapaxes(-1, -2), dor_in)
            dk, dv = _accumulate(dk, dk_b, kend), _accumulate(dv, dv_b, kend)
            # Rule 3: the accumulators move on only after this block's dq.
            dk, dv = _ordering.cotangent_after_gradients([dk, dv], [dq_b])
            dqs.append(dq_b)
        dqs = dqs[::-1]
        if empty_rows:
            dqs.insert(0, mx.zeros((B, Hkv, G, empty_rows, D), dtype=dtype))
        dq = mx.concatenate(dqs, axis=3) if len(dqs) > 1 else dqs[0]
        dq = dq.reshape(B, spec.Hq, T, D).astype(q.dtype)
        return [dq, dk.astype(k.dtype), dv.astype(v.dtype)] + d_masks

    return core


def _operands(dtype: mx.Dtype, w: mx.array, *xs: mx.array) -> tuple[mx.array, ...]:
    """The operands of the products of a block's float32 weights ``w`` (the
    probabilities ``p``, or the score gradient ``ds``) with ``xs`` (``v``, ``do``; ``k``,
    ``q``) for inputs of ``dtype``. In float16 ``w`` stays float32 and ``xs`` are
    upcast: float16's subnormals (below 6.1e-5, an absolute step of 6e-8) took the small
    weights of rows spread over many keys. A row whose weight sits on one key (an
    attention sink) and spreads the rest at ``p ~ 1e-7`` lost its ``o`` and the other
    keys' ``dv`` (10-21% off, 4e-4 now:
    ``test_a_sink_rows_diffuse_rest_keeps_o_and_dv_in_low_precision``; found by probing,
    session 53), a diffuse row its ``dq`` through ``ds``
    (``test_float16_small_gradients_of_diffuse_rows_keep_their_precision``, session 52).
    In bfloat16 ``w`` is rounded to it (tensor cores): its range is float32's, so small
    weights keep their relative precision (the sink test's bfloat16 case). A float32
    product costs more than a float16 one where float16 has faster units: on CUDA
    float16 runs these blocked ops (unmeasured)."""
    if dtype == mx.float16:
        return (w, *(x.astype(F32) for x in xs))
    return (w.astype(dtype), *xs)


def _scores_gradient(p: mx.array, dp: mx.array, scale: float) -> mx.array:
    """``ds = scale * p * (dp - delta)`` of a block in float32, from the float32 probabilities
    ``p`` and ``dp = do v^T``, with ``delta = sum_j p_j dp_j`` over its rows' keys (a
    block holds every key of its rows); zero where ``p`` is zero (not NaN), whatever
    ``dp`` and ``delta`` are there."""
    keep = mx.logical_or(p > 0, mx.isnan(p))
    dp = dp.astype(F32)
    delta = mx.sum(mx.where(keep, p * dp, 0.0), axis=-1, keepdims=True)
    # (where dp was zeroed instead of ds, a non-finite delta reached masked keys as
    # 0 * (0 - delta) = NaN, in a pattern that followed the blocks: found by review)
    return mx.where(keep, (scale * p) * (dp - delta), 0.0)


def _accumulate(acc: mx.array | None, part: mx.array, kend: int) -> mx.array:
    """``acc[:, :, :kend] += part`` in float32 (``acc`` None: ``part`` is the full length)."""
    part = part.astype(F32)
    if acc is None:
        return part
    if kend == acc.shape[2]:
        return acc + part
    return mx.slice_update(acc, acc[:, :, :kend] + part, mx.array([0]), axes=(2,))
