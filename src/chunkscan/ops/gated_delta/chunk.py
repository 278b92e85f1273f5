"""``gated_delta_rule``: the Gated DeltaNet recurrence in chunk form.

Only two things are sequential: the forward state pass and the backward pass of the
state gradient, both one recurrence over chunks behind :mod:`._passes` (portable MLX
ops everywhere, one fused kernel launch per group on CUDA). Everything else is computed
for a whole group of chunks at once, as a fixed number of batched ops (on CUDA, where
:func:`_fused` holds, one kernel launch each, :mod:`._chunk_cuda`): the WY/UT
preparation (:func:`_prepare`), the outputs given the entering states, and, in the
backward pass, every per-chunk gradient given the entering state and the leaving
state gradient, then the hand-derived backward of the preparation (no ``mx.vjp``).

One ``mx.custom_function`` covers the whole sequence. It keeps the state entering every
chunk (``T / C`` states; with ``CHUNKSCAN_GDN_SAVE=groups`` only the state entering each
group, :data:`_SAVE`); the backward walks the groups in reverse, recomputing each
group's preparation (on the fused path the last group's is kept from the forward,
:data:`_KEEP_PREPARED`), and the ordering rules of :mod:`chunkscan._ordering` free one
group's intermediates before the next group starts. Group sizes follow a byte budget
(:func:`_group_size`). The group math of per-channel gates is in :mod:`._channel`, the
UT inverse in :mod:`._triangular`. See ``docs/gated_delta.md`` for the math.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from types import SimpleNamespace

import mlx.core as mx

from ... import _backend, _ordering, _precompile, _tree
from ...split import split_at
from .._cpu_threads import matmul, threads
from .._finite import bad_rows, finite, finite_gate, finite_mask, gate_ok, non_finite_mask
from . import _chunk_cuda, _pass_cuda, _passes, _rows_cuda
from ._checks import Spec, check_inputs, empty_result
from ._triangular import unit_lower_inverse
from .naive import l2_normalize

F32 = mx.float32
_NAN = mx.array(math.nan, dtype=F32)
# Scratch of one group of chunks, in bytes; None: the environment variable
# CHUNKSCAN_GDN_GROUP_MIB, else 64 MiB on the CPU, 1024 MiB on an Apple GPU, and on a
# CUDA GPU 1/8 of its memory between 1024 and 16384 MiB (16384 on an H200, one group up
# to T = 65536 at the Qwen3-Next shape: _default_group_bytes; before session 29, 1/32 up
# to 4096, four groups there: 35.7 ms compiled / 37.8 eager against 31.5 / 33.0 with one,
# run 91, gdn_vs_fla_65536_groups_h200_7738238.json, at a peak of 264-280 KiB/token
# against 219-249). There every op and launch costs tens of microseconds, so fewer,
# larger groups pay: on the H200 at T = 16384 the fused op took 32.5 ms with 1024 MiB
# groups against 42.2 with 256 (bench/results/h200/gdn_group_mib_h200_fc22e35.json,
# gdn_save_16384_h200_fc22e35.json), and with the kernels of session 18, 17.5 ms eager
# and 14.6 compiled with 4096 MiB against 20.9 and 15.7 with 1024 at the same peak (run
# 59, gdn_vs_fla_16384_65536_h200_11e2478.json). The cost is memory where MLX is held to
# a limit (mx.set_memory_limit): the peak's floor is then the entering states, the input
# gradients and one group's scratch.
_GROUP_BYTES: int | None = None
# What the forward keeps for the backward where a call's save_states is None (a hook for
# the tests; else CHUNKSCAN_GDN_SAVE, else "chunks"): "chunks", the state entering every
# chunk, or "groups", the state entering each group (gated_delta_rule's docstring; the
# measurements: docs/gated_delta.md, "Backward").
_SAVE: str | None = None
SAVE_MODES = ("chunks", "groups")
# Whether the fused path (CUDA) keeps the last group's preparation from the forward for
# the backward, which starts with that group: None, CHUNKSCAN_GDN_KEEP_PREPARED (read at
# each call; "0" off), else on. With save_states="chunks" only: it keeps one group's
# a, p, w, u, kt (64 KiB per token at the Qwen3-Next shape with C = 64, up to the group's
# tokens) alive from the forward to the backward, where the backward would allocate the
# same again, and saves one of the two launches of `prepare` where the sequence is one
# group (T = 16384 on an H200: docs/gated_delta.md, "Backward").
_KEEP_PREPARED: bool | None = None
_KEPT_FIELDS = ("a", "p", "w", "u", "kt", "decay")  # _chunk_cuda.prepare's arrays
_SUB = 8  # steps per sub-chunk of a per-channel gate (chunks are a multiple of it)
# Whether the portable backward cuts its groups with split_at rather than slices (see
# core_vjp); the memory test's negative control.
_SPLIT_GROUPS = True


@_backend.reads_settings_once
def gated_delta_rule(
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
    save_states: str | None = None,
) -> tuple[mx.array, mx.array]:
    """Gated DeltaNet over a whole sequence, chunkwise, with a bounded-memory backward.

    Per value head, with the state ``S`` of shape ``[Dv, Dk]``, values and gradients
    match, to float tolerance (but what a chunk carries of its entering state at key
    heads well below the chunk: docs/gated_delta.md, "Numerics"), this loop
    (:func:`naive_recurrent_gated_delta_rule`)::

        for t in range(T):
            S = exp(g[t]) * S             # per-channel g[t] [Dk]: S * exp(g[t])[None, :]
            S = S + beta[t] * (v[t] - S @ k[t]) k[t]^T
            o[t] = scale * S @ q[t]

    Value head ``h`` uses key head ``h // (Hv // Hk)``. Unlike the loop, the forward
    is a few large batched products per group of chunks plus ``T / chunk_size``
    sequential state updates, and the backward is hand-derived: it keeps the
    ``T / chunk_size`` entering states (or one per group, ``save_states="groups"``)
    plus one group's recomputation. With ``cu_seqlens`` every sequence starts a chunk
    of its own, so chunks (states and work) number ``sum(ceil(len_n / C))``, up to
    ``T / C + N``: sequences much shorter than the chunk pay for its padding.

    Causal also for non-finite input: a NaN or infinity in ``k``, ``v``, ``beta`` or
    ``g`` (``g = +inf`` or NaN; ``g = -inf`` is a valid hard reset) at token ``t`` makes
    the head's outputs from ``t`` on (all its value channels, where the loop loses only
    the channel of a NaN in ``v``) and its final state NaN, but never the outputs or
    gradients of earlier tokens; a non-finite ``q[t]`` makes ``o[t]`` NaN. Not so for
    finite input whose chunk products overflow float32 (a key of norm ~1e19, or
    positive gates: see ``g``): the whole chunk reads NaN, and through the backward
    the earlier chunks' gradients too.

    Args:
        q (array): Queries ``[B, T, Hk, Dk]``.
        k (array): Keys ``[B, T, Hk, Dk]``.
        v (array): Values ``[B, T, Hv, Dv]``, ``Hv`` a multiple of ``Hk``.
        g (array): Log-decay ``[B, T, Hv]`` (the state is multiplied by ``exp(g)``:
            ``-inf`` resets it to zero; mlx-lm passes ``exp(g)``). Usually ``<= 0``
            (Gated DeltaNet's gates are). Positive values (growth) are allowed, but
            the chunk form multiplies and inverts, within a chunk, factors up to
            ``exp`` of the chunk's gate sum that cancel to results of ordinary size:
            its error relative to the result grows at least as float32's rounding
            times ``exp(chunk_size * gate)`` (3-14x that measured up to
            ``chunk_size * gate`` = 8, far faster beyond 10), and its gradients
            overflow to NaN or infinity before the loop's do. With a bounded state in
            float32 against a float64 loop (``bench/growth_gates.py --D 2 --beta 1``,
            T = 128) the worst relative error is 6.6e-3 at +0.3 per token with
            ``chunk_size=32`` and 6.4e+2 at +0.5 (the float32 loop: 5e-7 to 8e-7);
            with 8, 4.6e-6 and 9.4e-5. For growth, keep ``chunk_size * gate`` below
            about 4 (docs/gated_delta.md, "Positive gates").
            Or per key channel, ``[B, T, Hv, Dk]`` (Kimi Delta
            Attention): ``S = S * exp(g[t])[None, :]`` scales the state's key columns.
            Every decay of the chunk form is then a product of exactly the factors
            ``exp(g_s)`` it spans (no ``exp(-cumsum)``, no quotient), so any gates
            ``<= 0`` down to ``-inf`` (a reset of one column) are exact to float32
            rounding; a chunk of more than 8 steps is rounded up to a multiple of 8
            (sub-chunks; also where it is the longest sequence's length: 12 -> 16).
            Positive per-channel gates: the same limits as above
            (``bench/growth_gates.py --channel``).
            The sequential passes use the CUDA kernel as for the scalar gate.
        beta (array): Update strength ``[B, T, Hv]``.
        scale (float, optional): Output scale. Default: ``Dk ** -0.5``.
        initial_state (array, optional): ``[B, Hv, Dv, Dk]`` (or ``[N, Hv, Dv, Dk]``
            with ``cu_seqlens``, one per sequence). Default: zeros.
        chunk_size (int, optional): Steps per chunk; a performance knob (need not
            divide ``T``; larger than the longest sequence means one chunk), and for
            heads of a few key channels a precision one (``docs/gated_delta.md``,
            "Small key heads": keep it near ``Dk``).
            Default: ``None``: :func:`default_chunk_size` (32 on the CPU, 64 on an
            Apple GPU; on CUDA 64, or 32 or 128 where the fused kernels do not take
            64, and 128 with the kernels off; at most ``4 Dk``). On CUDA the fused
            chunk kernels take 32 or 64 (32: faster, twice the saved states) where
            the GPU's shared memory holds them; other sizes run the batched MLX ops,
            with a ``RuntimeWarning`` (once per size and head sizes) where another
            size is taken. Where the
            longest sequence is shorter than a chunk, the chunk is that sequence's
            length, but on the fused path the next size the kernels take (padded).
        normalize_qk (bool, optional): L2-normalise ``q`` and ``k`` over ``Dk`` first
            (``x / sqrt(sum(x**2) + 1e-6)``, differentiated). Default: ``False``.
        cu_seqlens (list of int or array, optional): Packed sequences: offsets
            ``[0, t1, ..., T]`` of ``N`` sequences concatenated along ``T`` in one row
            (``B`` must be 1; strictly increasing: no sequence is empty). The state
            restarts from ``initial_state[n]`` (or zeros) at each start. Static: read
            once, not traced; under ``mx.compile`` pass it as an argument of the
            compiled function (a list the function reads from a closure or an
            attribute keeps the first trace's sequences: wrong values, no error).
            Default: ``None``.
        kernels (bool, optional): Use the CUDA kernels where they apply: the
            sequential passes, and for scalar gates with ``chunk_size`` 32 or 64 and
            head sizes that are multiples of 32 up to 128, every chunk-parallel stage
            (``docs/gated_delta.md``, "On CUDA"). ``None``: on a CUDA device unless
            the environment variable ``CHUNKSCAN_CUDA_KERNELS=0``; ``True``: on a
            CUDA device whatever that variable says (elsewhere there are none: the
            portable ops, no error); ``False``: always the portable MLX ops. The
            kernels' products are TF32 where MLX's own float32 matmuls are (on CUDA
            unless ``MLX_ENABLE_TF32=0``; relative errors
            ~5e-4, as the portable path's there), float32 otherwise
            (``CHUNKSCAN_GDN_TF32=0`` or ``1`` forces either); with float32 products
            both paths agree to float32 tolerance. Default: ``None``.
        save_states (str, optional): What the forward keeps for the backward:
            ``"chunks"``, the float32 state entering every chunk (``T / chunk_size``
            states: 32 KiB per token at the Qwen3-Next shape with C = 64), or ``"groups"``, the
            state entering each group of chunks only; the backward then recomputes
            the others with one more forward state pass per group. Identical results.
            ``"groups"`` suits models with many such layers at long ``T``, whose saved
            states add up (on the H200, a LoRA step at T = 32768: 8% less peak memory,
            2% more time; the op alone: about 15% more time). With ``"chunks"`` the
            fused CUDA path also keeps the last group's preparation for the backward,
            which starts with that group (one ``prepare`` launch fewer; 64 KiB per
            token of that group at the Qwen3-Next shape, alive from the forward to the
            backward; ``CHUNKSCAN_GDN_KEEP_PREPARED=0`` switches it off). ``None``: the
            environment variable ``CHUNKSCAN_GDN_SAVE``, else ``"chunks"``.
            Default: ``None``.

    Returns:
        tuple: ``(o, final_state)``: ``o`` ``[B, T, Hv, Dv]`` in the dtype of ``q``;
        ``final_state`` ``[B, Hv, Dv, Dk]`` (``[N, Hv, Dv, Dk]`` with ``cu_seqlens``)
        in float32.

    Example:
        >>> o, s = chunkscan.gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    """
    if chunk_size is None:
        _backend.check_kernels("gated_delta_rule", kernels)  # (its name in the message)
        shaped = all(isinstance(x, mx.array) and x.ndim == 4 for x in (q, v))
        dims = (q.shape[-1], v.shape[-1]) if shaped else (128, 128)  # checked just below
        chunk_size = default_chunk_size(kernels, *dims)
    spec = check_inputs(
        "gated_delta_rule", q, k, v, g, beta, scale, initial_state, chunk_size, cu_seqlens,
        normalize_qk=normalize_qk,
    )  # fmt: skip
    cuda = _passes.use_kernels(kernels, "gated_delta_rule")
    save = _saved_states(save_states)
    _check_fused_settings()
    _group_mib_setting()  # read, and so checked, before a call of no tokens returns
    threads()
    empty = empty_result(spec, q, initial_state)
    if empty is not None:
        return empty
    out_dtype = q.dtype
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    chunks = _Chunking(spec, _fused_sizes(spec, cuda))
    if initial_state is None:
        h0 = mx.zeros((spec.n_states, spec.Hv, spec.Dv, spec.Dk), dtype=F32)
    else:
        h0 = initial_state.astype(F32)
    o_bad, seq_bad = _non_finite_reach(spec, q, k, v, g, beta, kernel=cuda)
    raw = [chunks.to_chunks(x) for x in (q, k, v, g, beta, o_bad)]
    fused = _fused(spec, chunks.C, cuda)
    if cuda and not fused and chunk_size is not None:
        _warn_on_a_size_the_kernels_skip(spec)
    core = _make_core(spec, chunks, out_dtype, cuda, fused, save, _backend.settings_in_effect())
    outs = _tree.as_list(core(*raw, h0))
    o, final = chunks.from_chunks(outs[0]), outs[1]
    final = mx.where(seq_bad[..., None, None], mx.array(math.nan, dtype=F32), final)
    return o, final


def default_chunk_size(kernels: bool | None = None, Dk: int = 128, Dv: int = 128) -> int:
    """The ``chunk_size`` :func:`gated_delta_rule` uses when given none, for head sizes
    ``Dk``, ``Dv``: the backend's size below, but at most ``4 Dk`` (rounded down to a
    power of two) for heads of a few key channels, whose chunks lose precision in what
    they carry of the state entering them (``docs/gated_delta.md``, "Small key heads";
    until session 54 the default was 32 on the CPU for any ``Dk``, found by probing).
    On the CPU: 32 (fewer multiply-adds than 64, the chunk-local
    ``[C, C]`` products shrinking with ``C``; at the Qwen3-Next layer shape, T = 1024,
    13.2x mlx-lm's loop measured in the same run against 10.8x with 64 on two cores,
    8.2x against 6.9x on one, for 109 / 90 KiB per token at T = 2048 / 8192 against
    85 / 62: ``docs/gated_delta.md``, "On the CPU").
    On an Apple GPU: 64. On a CUDA GPU: 64 where the fused chunk kernels take it, else
    32 where they take that (a GPU with less shared memory per block than an H100's: an
    A100, 163 KiB, for heads of 64 or more, a consumer GPU, 99 KiB, for all; an
    explicit ``chunk_size=64`` there runs the batched MLX ops), else 128, as with the
    kernels off (``kernels=False`` or
    ``CHUNKSCAN_CUDA_KERNELS=0``): the batched ops run fewer, larger ops there
    (measured 1.2-1.5x faster at the Qwen3-Next layer shape on an H200). Raises
    ``TypeError`` / ``ValueError`` for a ``kernels`` that is not a bool or ``None`` and
    head sizes that are not ints of at least 0 (taken on the CPU before; found by
    probing)."""
    _backend.check_kernels("default_chunk_size", kernels)
    for name, size in (("Dk", Dk), ("Dv", Dv)):
        # (the wrong type a TypeError, as the package's other checks raise it: a
        # ValueError before; found by probing, session 52)
        an_int = isinstance(size, numbers.Integral) and not isinstance(size, bool)
        error = ValueError if an_int else TypeError
        if not an_int or size < 0:
            raise error(
                f"[default_chunk_size] {name} must be an int of at least 0 (a head size) "
                f"but got {size!r}. Pass the head size as an int, e.g. {name}=128."
            )
    return min(_backend_chunk_size(kernels, Dk, Dv), _small_head_chunk_size(Dk))


def _backend_chunk_size(kernels: bool | None, Dk: int, Dv: int) -> int:
    if not _passes.cuda_device():
        return 32 if mx.default_device() == mx.cpu else 64
    if not _passes.use_kernels(kernels, "gated_delta_rule"):
        return 128
    for C in sorted(_chunk_cuda.CHUNK_SIZES, reverse=True):
        if _chunk_cuda.supports(C, Dk, Dv, False, strict=True):
            return C
    return 128


# The default chunk of heads of a few key channels: at most this many times Dk (a
# power of two). Below, a chunk's product of transitions loses the relative precision of
# what it carries of the entering state (docs/gated_delta.md, "Small key heads"): the
# initial state's gradient at C = 4 Dk was within 6x of the float32 loop's, at Dk = 2 to
# 16 (at Dk = 2: 2.5e-5 against 7.6e-6, and 0.12 at the CPU's 32 before session 54).
_SMALL_HEAD_CHUNKS_PER_DK = 4
_SMALL_HEAD_CHUNK_SIZE = True  # False: the backend's size alone (negative control)


def _small_head_chunk_size(Dk: int) -> int:
    """The largest power of two at most ``_SMALL_HEAD_CHUNKS_PER_DK * Dk`` (no bound for
    ``Dk = 0``, a call of no key channels). At ``Dk = 1`` that is 4, the weakest case of
    the rule: a review measured the error there well above the loop's (not a test)."""
    if not _SMALL_HEAD_CHUNK_SIZE or Dk == 0:
        return 1 << 30
    return 1 << ((_SMALL_HEAD_CHUNKS_PER_DK * Dk).bit_length() - 1)


def _fused_sizes(spec: Spec, kernels: bool) -> tuple[int, ...]:
    """The chunk sizes up to ``spec.chunk_size`` that the fused chunk kernels take for
    this call, where they take ``spec.chunk_size`` itself (else none): a sequence
    shorter than a chunk is padded to the next of them rather than cut to a size no
    kernel takes (a call whose longest sequence had 33-63 tokens ran the batched MLX
    ops at ``chunk_size=64``, found by probing the op)."""
    if not _fused(spec, spec.chunk_size, kernels, strict=True):
        return ()
    sizes = _chunk_cuda.CHUNK_SIZES
    return tuple(C for C in sizes if C <= spec.chunk_size and _fused(spec, C, kernels))


_WARNED_SIZES: set[tuple[int, int, int]] = set()


def _warn_on_a_size_the_kernels_skip(spec: Spec) -> None:
    """Warn, once per (chunk size, Dk, Dv), where a given ``chunk_size`` is one the fused
    CUDA kernels do not take on this GPU but another is: the batched MLX ops ran
    instead, several times slower, with no word (an explicit ``chunk_size=64`` on an
    A100 at heads of 64 or more; found by the emulator probe)."""
    C, Dk, Dv = spec.chunk_size, spec.Dk, spec.Dv
    if spec.channel or (C, Dk, Dv) in _WARNED_SIZES:
        return
    lanes = spec.B * spec.Hv
    if _chunk_cuda.supports(C, Dk, Dv, False, lanes=lanes):
        return  # taken (a sequence shorter than a chunk may still run the batched ops)
    better = [c for c in _chunk_cuda.CHUNK_SIZES if _chunk_cuda.supports(c, Dk, Dv, False, lanes)]
    if not better:
        return  # no size is taken here (the documented fallback, whatever the size)
    _WARNED_SIZES.add((C, Dk, Dv))
    kib = _backend.cuda_limits().smem_per_block // 1024
    warnings.warn(
        f"[gated_delta_rule] chunk_size={C} is not a size the fused CUDA kernels take on "
        f"this GPU at Dk={Dk}, Dv={Dv} ({kib} KiB of shared memory per block), so the "
        f"batched MLX ops run instead, several times slower. Pass chunk_size={max(better)}, "
        "or None for the default.",
        RuntimeWarning,
        stacklevel=4,  # the caller of gated_delta_rule (through reads_settings_once)
    )


def _fused(spec: Spec, C: int, kernels: bool, strict: bool = False) -> bool:
    """Whether a call runs the fused chunk kernels of :mod:`._chunk_cuda` (CUDA kernels
    on, scalar gates, a shape they handle); otherwise the batched MLX ops below
    (``strict``: the size the call asked for, :func:`._chunk_cuda.supports`)."""
    return kernels and _chunk_cuda.supports(
        C, spec.Dk, spec.Dv, spec.channel, lanes=spec.B * spec.Hv, strict=strict
    )


class _Chunking:
    """How tokens map onto chunks; each packed sequence starts its own chunk.

    The padded tokens at the end of a sequence's last chunk have ``g = 0`` and
    ``beta = 0``: the state passes them unchanged and their outputs are dropped.
    ``starts`` / ``ends`` map a chunk index to the sequence that starts / ends there.
    """

    def __init__(self, spec: Spec, fit: tuple[int, ...] = ()) -> None:
        """``fit``: chunk sizes to round a shorter chunk up to (the smallest that holds
        the longest sequence; :func:`_fused_sizes`)."""
        self.spec = spec
        lengths = [spec.T] if spec.seqs is None else [hi - lo for lo, hi in spec.seqs]
        C = min(spec.chunk_size, max(lengths))
        if spec.channel and C > _SUB:
            C = -(-C // _SUB) * _SUB  # per-channel gates: whole sub-chunks
        C = min((size for size in fit if size >= C), default=C)
        self.C = C
        self.starts: dict[int, int] = {}
        self.ends: dict[int, int] = {}
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
        """``[B, N, C, ...]`` -> ``[B, T, ...]``."""
        o = o.reshape((o.shape[0], self.N * self.C) + tuple(o.shape[3:]))
        if self.packed:
            return mx.take(o, self.scatter, axis=1)
        return o[:, : self.spec.T] if self.pad else o

    def groups(self, size: int) -> list[tuple[int, int]]:
        return [(c, min(self.N, c + size)) for c in range(0, self.N, size)]

    def local(self, table: dict[int, int], c0: int, c1: int) -> dict[int, int]:
        """The entries of ``table`` inside chunks ``[c0, c1)``, indexed from ``c0``."""
        return {c - c0: s for c, s in table.items() if c0 <= c < c1}


def _make_core(
    spec: Spec,
    chunks: _Chunking,
    out_dtype: mx.Dtype,
    kernels: bool,
    fused: bool,
    save: str,
    settings: dict | None = None,
):
    """The custom function ``(q, k, v, g, beta, o_bad, h0) -> [o, final, *entering]``.

    ``kernels``: the state passes run the CUDA kernel; ``fused``: the chunk-parallel
    stages run the kernels of :mod:`._chunk_cuda` (same math, same ordering rules);
    ``save``: what the forward keeps, resolved by :func:`_saved_states`; ``settings``:
    what the forward's call read (:func:`chunkscan._backend.settings_in_effect`), which
    the vjp takes as read: one plan per call, forward and backward.

    Inputs in chunk layout ``[B, N, C, ...]`` and dtype (``o_bad`` ``[B, N, C, Hv]``
    bool: outputs set to NaN, see :func:`_non_finite_reach`); ``h0``
    ``[n, Hv, Dv, Dk]`` float32. The outputs after ``o`` (``[B, N, C, Hv, Dv]``) and ``final``
    (``[n, Hv, Dv, Dk]``) are the states entering every chunk, one array
    ``[L, n_g, Dv, Dk]`` per group (``L = B * Hv`` lanes), kept for the backward;
    with ``save="groups"`` the state entering each group after the first instead;
    then, where the fused path keeps it (:func:`_keep_last_preparation`), the last
    group's preparation (:data:`_KEPT_FIELDS`), which its backward uses in place of a
    second ``prepare`` launch (the same kernel on the same inputs: the same values).
    """
    B, Hk, G, Hv, Dk, Dv = spec.B, spec.Hk, spec.G, spec.Hv, spec.Dk, spec.Dv
    L, n_seq = B * Hv, spec.n_states
    groups = chunks.groups(_group_size(spec, chunks.C, fused=fused, save=save))
    keep_chunks = save == "chunks"
    keep_last = fused and keep_chunks and _keep_last_preparation()
    if spec.channel:
        from . import _channel  # imports this module: here, not at the top

        prepare = functools.partial(_channel.prepare, full=False)
        prepare_full = functools.partial(_channel.prepare, full=True)
        group_backward = _channel.group_backward
    else:
        prepare = prepare_full = _prepare
        group_backward = _group_backward

    def lanes(x: mx.array) -> mx.array:
        """``[B, Hk, G, n, ...]`` -> ``[L, n, ...]``."""
        return x.reshape((L,) + tuple(x.shape[3:]))

    def per_head(x: mx.array) -> mx.array:
        """``[L, n, ...]`` -> ``[B, Hk, G, n, ...]``."""
        return x.reshape((B, Hk, G) + tuple(x.shape[1:]))

    def per_head_or_none(x: mx.array | None) -> mx.array | None:
        return None if x is None else per_head(x)

    def seq_states(x: mx.array) -> mx.array:
        """``[n_seq, Hv, Dv, Dk]`` -> ``[n_seq or 1, L, Dv, Dk]`` (what ``loads`` read)."""
        return x.reshape(1 if not chunks.packed else n_seq, L, Dv, Dk)

    def from_lanes_states(parts: dict[int, mx.array]) -> mx.array:
        """Per sequence ``[L, Dv, Dk]`` -> ``[n_seq, Hv, Dv, Dk]``."""
        if not chunks.packed:
            return parts[0].reshape(B, Hv, Dv, Dk)
        return mx.stack([parts[s] for s in range(n_seq)], axis=0)

    @mx.custom_function
    def core(q, k, v, g, beta, o_bad, h0):
        inits = seq_states(h0)
        outs, saved, finals = [], [], {}
        state = None
        kept: list[mx.array] = []
        for gi, (c0, c1) in enumerate(groups):
            xs = [x[:, c0:c1] for x in (q, k, v, g, beta)]
            # Rule 5: the group's preparation waits for the state entering it, so that
            # groups are prepared one after the other, not all up front (it matters for
            # per-channel gates, whose preparation is the larger: see the tests).
            xs = _ordering.prepare_after_carry(xs, [] if state is None else [state])
            ends = chunks.local(chunks.ends, c0, c1)
            if fused:
                keep = keep_last and gi == len(groups) - 1
                p = _chunk_cuda.prepare(*xs, spec.scale, with_a=keep)
                if keep:
                    kept = [getattr(p, f) for f in _KEPT_FIELDS]
                operands = (p.decay, p.w, p.u, p.kt)
            else:
                p = prepare(*xs, spec.scale)
                operands = (lanes(p.decay), lanes(p.w), lanes(p.u), lanes(p.kt))
            entering, state, stored, v_new = _passes.state_pass(
                state, *operands, None,
                reverse=False, loads=chunks.local(chunks.starts, c0, c1),
                stores={c: i for i, c in enumerate(ends)}, inits=inits, kernels=kernels,
                values=True,
            )  # fmt: skip
            for i, c in enumerate(ends):
                finals[ends[c]] = stored[i]
            if fused:
                o = _chunk_cuda.outputs(xs[0], xs[3], p, entering, o_bad[:, c0:c1], out_dtype)
            else:
                o = _group_outputs(
                    p, per_head(entering), o_bad[:, c0:c1], out_dtype, per_head_or_none(v_new)
                )
            # Rule 1: the state leaves the group only after the group's outputs exist.
            state = _ordering.carry_after_outputs([state], [o])[0]
            outs.append(o)
            if keep_chunks:
                saved.append(entering)
            elif gi + 1 < len(groups):
                saved.append(state)  # the state entering the next group
        return [_cat(outs, 1), from_lanes_states(finals), *saved, *kept]

    @core.vjp
    @_backend.reads_settings_of(settings)
    def core_vjp(primals, cotangents, outputs):
        xs_all = _tree.as_list(primals)[:5]
        o_bad = _tree.as_list(primals)[5]
        ct_o, ct_final = _tree.as_list(cotangents)[:2]
        n_saved = len(groups) if keep_chunks else len(groups) - 1
        saved = _tree.as_list(outputs)[2 : 2 + n_saved]
        # The saved states are outputs too: a gradient of this backward (a second
        # derivative) sends them cotangents, which join the state's where the state
        # was saved. Without this, every second derivative through a saved state was
        # wrong with no error (found by probing the op). In a first derivative they are
        # MLX's zeros, and the portable path pays one addition of them per group (within
        # the noise at T = 1024 on the CPU: 2.84 s with it, 3.04 without, medians of
        # four alternating runs each); with the kernels on, a second derivative stops at
        # MLX's error for the kernels (``[Primitive::vjp] Not implemented for
        # CustomKernel``), so the fused path skips the sum.
        ct_saved = None if kernels else _tree.as_list(cotangents)[2 : 2 + n_saved]
        kept = _tree.as_list(outputs)[2 + n_saved :]  # the last group's preparation
        ct_inits = seq_states(ct_final.astype(F32))
        inits = seq_states(_tree.as_list(primals)[6])
        grads: list[list[mx.array]] = [[] for _ in range(5)]
        d_h0: dict[int, mx.array] = {}
        d_state = None
        chain = [ct_final]  # the cotangent entering the group, to order the groups
        # The portable path's groups cut with split_at (a concatenate as its vjp): a
        # second derivative differentiates this backward, and a plain slice's vjp is a
        # zero-padded buffer of the whole sequence per group (found by probing: the
        # peak grew with the square of T where groups were many). The fused path has
        # no second derivative (its kernels have no vjp) and keeps its slices.
        cuts = [c0 for c0, _ in groups[1:]] if _SPLIT_GROUPS and not fused else []
        cut_xs = [split_at(x, cuts, 1) for x in xs_all] if cuts else None
        cut_ct_o = split_at(ct_o, cuts, 1) if cuts else None
        for gi in reversed(range(len(groups))):
            c0, c1 = groups[gi]
            if ct_saved and not keep_chunks and gi + 1 < len(groups):
                d_state = d_state + ct_saved[gi]  # the state leaving the group was saved
            # Rule 2: recompute the group only once the cotangent flowing into it exists.
            xs = [x[gi] for x in cut_xs] if cut_xs else [x[:, c0:c1] for x in xs_all]
            xs = _ordering.recompute_after_cotangent(xs, chain)
            starts = chunks.local(chunks.starts, c0, c1)
            if fused:
                if kept and gi == len(groups) - 1:
                    p = SimpleNamespace(scale=spec.scale, **dict(zip(_KEPT_FIELDS, kept)))
                else:
                    p = _chunk_cuda.prepare(*xs, spec.scale)
                forward = (p.decay, p.w, p.u, p.kt)
                d_o = ct_o[:, c0:c1]  # [B, n, C, Hv, Dv], zero where o_bad in the kernels
                h = _chunk_cuda.state_gradient_input(xs[0], xs[3], p, d_o, o_bad[:, c0:c1])
                operands = (p.decay, p.kt, None, p.w, h)
            else:
                p = prepare_full(*xs, spec.scale)
                forward = (lanes(p.decay), lanes(p.w), lanes(p.u), lanes(p.kt))
                d_o = cut_ct_o[gi] if cut_ct_o else ct_o[:, c0:c1]
                d_o = mx.where(o_bad[:, c0:c1, ..., None], 0.0, d_o.astype(F32))
                d_o = d_o.reshape(B, c1 - c0, chunks.C, Hk, G, Dv)
                d_o = d_o.transpose(0, 3, 4, 1, 2, 5)  # [B, Hk, G, n, C, Dv]
                # The state-independent part of the state gradient, for every chunk.
                h = matmul(d_o.swapaxes(-1, -2), p.qg - matmul(p.p, p.w))  # [B, Hk, G, n, Dv, Dk]
                if ct_saved and keep_chunks:  # the states entering the chunks were saved:
                    h = h + per_head(ct_saved[gi])  # their cotangents join at the chunk
                operands = (lanes(p.decay), lanes(p.kt), None, lanes(p.w), lanes(h))
            # v_back: -(K * to_end) dS^T per chunk, where the pass forms it (a term of
            # the gradient of U, which the group's backward then need not recompute).
            d_leaving, d_state, stored, v_back = _passes.state_pass(
                d_state, *operands,
                reverse=True, loads=chunks.local(chunks.ends, c0, c1),
                stores={c: i for i, c in enumerate(starts)}, inits=ct_inits, kernels=kernels,
                values=True,
            )  # fmt: skip
            for i, c in enumerate(starts):
                d_h0[starts[c]] = stored[i]
            v_new = None
            if keep_chunks:
                entering = saved[gi]
            else:  # the forward kept the state entering the group: its chunks' again
                entering, _, _, v_new = _passes.state_pass(
                    None if gi == 0 else saved[gi - 1], *forward, None,
                    reverse=False, loads=starts, stores={}, inits=inits, kernels=kernels,
                    values=True,
                )  # fmt: skip
            if fused:
                sg = _chunk_cuda.state_gradients(
                    p, entering, d_leaving, d_o, o_bad[:, c0:c1], xs[2]
                )
                d_xs = _chunk_cuda.input_gradients(xs, p, sg)
            else:
                d_xs = group_backward(
                    p, xs, per_head(entering), per_head(d_leaving), d_o,
                    per_head_or_none(v_new), per_head_or_none(v_back),
                )  # fmt: skip
            # Rule 3: the cotangent leaves the group only after its input gradients.
            d_state = _ordering.cotangent_after_gradients([d_state], d_xs)[0]
            chain = [d_state]
            for parts, d in zip(grads, d_xs):
                parts.append(d)
        # Rule 4: one concatenate per input.
        d_inputs = [_cat(parts[::-1], 1) for parts in grads]
        return d_inputs + [mx.zeros_like(o_bad), from_lanes_states(d_h0)]

    return core


def check_save_states(fn: str, save: object, none: str) -> str:
    """``save`` if it is one of :data:`SAVE_MODES`; else a ``TypeError`` (not a string)
    or ``ValueError`` naming the value and the fix (found by probing: ``1`` was a
    ``ValueError`` without a fix, ``'Chunks'`` got no hint). ``none`` says what ``None``
    means where ``fn`` takes it."""
    if isinstance(save, str) and save in SAVE_MODES:  # (an array would compare by element)
        return save
    rule = f"[{fn}] save_states must be 'chunks' or 'groups' (or None: {none})"
    fix = "Pass save_states='chunks' (every chunk's entering state kept) or 'groups'."
    if not isinstance(save, str):
        raise TypeError(f"{rule} but got {save!r} ({type(save).__name__}). {fix}")
    if save.strip().lower() in SAVE_MODES:
        fix = f"Pass save_states={save.strip().lower()!r} (lower case, no spaces)."
    raise ValueError(f"{rule} but got {save!r}. {fix}")


def _saved_states(save: str | None = None) -> str:
    """``save`` (``gated_delta_rule``'s ``save_states``) if given, else :data:`_SAVE`,
    else ``CHUNKSCAN_GDN_SAVE``, else ``"chunks"``; one of :data:`SAVE_MODES`."""
    if save is not None:
        return check_save_states("gated_delta_rule", save, "CHUNKSCAN_GDN_SAVE, else 'chunks'")
    if _SAVE:
        return _SAVE
    return _backend.env_choice(
        "CHUNKSCAN_GDN_SAVE", "gated_delta_rule", SAVE_MODES,
        "chunks (the state entering every chunk kept for the backward, the default) or "
        "groups (the state entering every group)",
    ) or "chunks"  # fmt: skip


def _keep_last_preparation() -> bool:
    """:data:`_KEEP_PREPARED` if set, else ``CHUNKSCAN_GDN_KEEP_PREPARED`` (``"0"``: no;
    ``"1"`` or unset: yes)."""
    if _KEEP_PREPARED is not None:
        return _KEEP_PREPARED
    flag = _backend.env_choice(
        "CHUNKSCAN_GDN_KEEP_PREPARED", "gated_delta_rule", ("0", "1"),
        "0 (the backward recomputes the last group's preparation) or 1 (kept from the "
        "forward, the default)",
    )  # fmt: skip
    return flag != "0"


def _check_fused_settings() -> None:
    """Read, and so check, the settings only the CUDA kernels use, on every path: a bad
    value raises wherever the call runs, not first on a GPU (``banana`` passed the CPU
    silently; found by probing; since session 35 every kernel setting, not two)."""
    _keep_last_preparation()
    _backend.tf32_products("gated_delta_rule")
    _chunk_cuda.check_settings()
    _pass_cuda.check_settings()
    _precompile.mode()
    _precompile.line_info()


def _cat(parts: list[mx.array], axis: int) -> mx.array:
    """The groups' ``parts`` joined along ``axis`` (1: the chunks). Where every axis
    before it has size 1 (``B = 1``), as a concatenation along axis 0 of the parts
    without those axes: the same values, but MLX's CUDA back-end copies each
    row-contiguous part with its vector copy there, against a general strided copy
    along any other axis (Nsight Compute at T = 65536, four groups: 24 such copies,
    1.15 ms strided, run 84; 0.82 ms as vector copies, run 86)."""
    if len(parts) == 1:
        return parts[0]
    lead = parts[0].shape[:axis]
    if any(d != 1 for d in lead):
        return mx.concatenate(parts, axis=axis)
    joined = mx.concatenate([x.reshape(x.shape[axis:]) for x in parts], axis=0)
    return joined.reshape(lead + joined.shape)


def _group_size(
    spec: Spec, C: int, budget: int | None = None, fused: bool = False, save: str | None = None
) -> int:
    """Chunks per group: a group's scratch (about twenty ``[C, D]``, ``[C, C]`` or
    ``[D, D]`` float32 arrays per chunk and value head; with the fused kernels, what
    :mod:`._chunk_cuda` writes; with ``save="groups"`` the recomputed entering states;
    default :func:`_saved_states`) stays near ``budget`` bytes (default ``_GROUP_BYTES``):
    an estimate, near it at the model shapes and above it at small heads (``D = 32``,
    where the terms above undercount; found by probing, session 51). The peak stays
    one group's either way."""
    D = max(spec.Dk, spec.Dv)
    per_chunk = 4 * spec.B * spec.Hv * (12 * C * max(D, C) + 6 * D * D)
    if fused:
        per_chunk = 4 * spec.B * spec.Hv * _chunk_cuda.scratch_floats(C, spec.Dk, spec.Dv)
    if (save or _saved_states()) == "groups":  # the entering states, recomputed
        per_chunk += 4 * spec.B * spec.Hv * spec.Dv * spec.Dk
    if spec.channel:  # sub-chunk arrays: ~8 [P, b, Dk] (P ~ m^2 / 2) and ~8 [C, b, Dk]
        from ._channel import sub_size  # imports this module: here, not at the top

        b = sub_size(C)
        per_chunk += 4 * spec.B * spec.Hv * spec.Dk * C * (4 * (C // b) + 8 * b)
    if budget is None:
        budget = _GROUP_BYTES
    if budget is None:
        mib = _group_mib_setting()
        budget = None if mib is None else mib << 20
    if budget is None:
        budget = _default_group_bytes()
    return max(1, budget // per_chunk)


def _group_mib_setting() -> int | None:
    """``CHUNKSCAN_GDN_GROUP_MIB`` (at least 1), ``None`` where unset."""
    return _backend.env_group_mib("CHUNKSCAN_GDN_GROUP_MIB", "gated_delta_rule")


def _default_group_bytes() -> int:
    """The group budget without a setting (see ``_GROUP_BYTES``): 64 MiB on the CPU,
    1024 MiB on an Apple GPU, 1/8 of a CUDA GPU's memory from 1024 to 16384 MiB (1024
    where MLX reports no memory size)."""
    if mx.default_device() == mx.cpu:
        return 64 << 20
    return _gpu_group_bytes(_backend.cuda_memory_bytes())


def _gpu_group_bytes(total: int | None) -> int:
    """The GPU's group budget given its memory in bytes (``None``: not a CUDA GPU, or
    unknown)."""
    if total is None:
        return 1024 << 20
    return min(16384 << 20, max(1024 << 20, total // 8))


def _prepare(q, k, v, g, beta, scale: float) -> SimpleNamespace:
    """:func:`_prepare_arrays` as a namespace (compiled with ``_COMPILE_GROUPS``)."""
    fn = _compiled(_prepare_arrays) if _COMPILE_GROUPS else _prepare_arrays
    return SimpleNamespace(**fn(q, k, v, g, beta, scale), scale=scale)


def _prepare_arrays(q, k, v, g, beta, scale: float) -> dict[str, mx.array]:
    """Everything that does not depend on the state, for ``n`` chunks at once.

    Inputs ``[B, n, C, H, D]`` / ``[B, n, C, Hv]`` (non-finite values read as zero: the
    wrapper poisons what they reach). Shapes (``G = Hv // Hk``; key-head arrays have a
    broadcast axis ``1`` in place of ``G``): ``q``, ``k`` ``[B, Hk, 1, n, C, Dk]``;
    ``v`` ``[B, Hk, G, n, C, Dv]``; ``g``, ``beta``, ``gamma``, ``to_end``
    ``[B, Hk, G, n, C]``; ``decay`` ``[B, Hk, G, n]``; ``kk``, ``qk``
    ``[B, Hk, 1, n, C, C]``; ``gam`` (``gamma_i / gamma_j``, zero above the
    diagonal), ``a`` (the UT inverse), ``p`` ``[B, Hk, G, n, C, C]``; ``w``, ``kb``,
    ``qg``, ``kt`` ``[B, Hk, G, n, C, Dk]``; ``u``, ``vb`` ``[B, Hk, G, n, C, Dv]``.
    """
    B, n, C, Hk, _ = q.shape
    Hv, Dv = v.shape[-2:]
    G = Hv // Hk
    qf = finite(q).astype(F32).transpose(0, 3, 1, 2, 4)[:, :, None]
    kf = finite(k).astype(F32).transpose(0, 3, 1, 2, 4)[:, :, None]
    vf = finite(v).astype(F32).reshape(B, n, C, Hk, G, Dv).transpose(0, 3, 4, 1, 2, 5)
    gf = finite_gate(g).astype(F32).reshape(B, n, C, Hk, G).transpose(0, 3, 4, 1, 2)
    bf = finite(beta).astype(F32).reshape(B, n, C, Hk, G).transpose(0, 3, 4, 1, 2)

    # Log-decays relative to the chunk, each a sum of exactly the gates it spans (no
    # difference of two cumulative sums): no cancellation after a very negative gate,
    # and g = -inf (a hard reset) gives zero decays rather than NaN.
    gcum = mx.cumsum(gf, axis=-1)  # from the chunk start through step i
    to_end = mx.cumsum(gf, axis=-1, reverse=True, inclusive=False)  # after step j
    strict = _strict(C)
    rel = mx.cumsum(mx.where(strict, gf[..., :, None], 0.0), axis=-2)  # g_{j+1} + .. + g_i
    gam = mx.exp(mx.where(_causal(C), rel, -mx.inf))  # gamma_i / gamma_j, zero above

    kt_ = kf.swapaxes(-1, -2)
    kk = matmul(kf, kt_)
    qk = matmul(qf, kt_)
    a = unit_lower_inverse(mx.where(strict, bf[..., :, None] * gam * kk, 0.0))
    gamma = mx.exp(gcum)
    to_end = mx.exp(to_end)
    kb = kf * (bf * gamma)[..., None]
    vb = vf * bf[..., None]
    return dict(
        q=qf, k=kf, v=vf, g=gf, beta=bf, gamma=gamma, to_end=to_end,
        decay=mx.exp(gcum[..., -1]), kk=kk, qk=qk, gam=gam, a=a, kb=kb, vb=vb,
        w=matmul(a, kb), u=matmul(a, vb), qg=qf * (scale * gamma)[..., None], p=(scale * qk) * gam,
        kt=kf * to_end[..., None],
    )  # fmt: skip


def _group_outputs(
    p: SimpleNamespace,
    s: mx.array,
    o_bad: mx.array,
    dtype: mx.Dtype,
    v_new: mx.array | None = None,
):
    """Outputs ``[B, n, C, Hv, Dv]`` of a group given the states entering its chunks
    ``s`` ``[B, Hk, G, n, Dv, Dk]``: ``o = qg S^T + p v_new`` with ``v_new = u - w S^T``
    (``[B, Hk, G, n, C, Dv]``; computed here where not given: the state pass formed it
    on the CPU), NaN where ``o_bad``."""
    fn = _compiled(_group_outputs_arrays) if _COMPILE_GROUPS else _group_outputs_arrays
    return fn(p.qg, p.p, p.u, p.w, s, o_bad, v_new).astype(dtype)


def _group_outputs_arrays(qg, pm, u, w, s, o_bad, v_new=None):
    st = s.swapaxes(-1, -2)
    if v_new is None:
        v_new = u - matmul(w, st)
    o = matmul(qg, st) + matmul(pm, v_new)
    B, _, _, n, C, Dv = o.shape
    o = o.transpose(0, 3, 4, 1, 2, 5).reshape(B, n, C, -1, Dv)
    return mx.where(o_bad[..., None], _NAN, o)


def _group_backward(p: SimpleNamespace, xs, s, d_s, d_o, v_new=None, v_back=None) -> list[mx.array]:
    """:func:`_group_backward_arrays` (compiled with ``_COMPILE_GROUPS``)."""
    fn = _compiled(_group_backward_arrays) if _COMPILE_GROUPS else _group_backward_arrays
    arrays = {key: value for key, value in vars(p).items() if key != "scale"}
    return fn(arrays, list(xs), s, d_s, d_o, p.scale, v_new, v_back)


def _state_terms(p: SimpleNamespace, s, d_s, d_o, v_new, v_back):
    """``v_new = u - w S^T`` and its cotangent ``p^T dO + kt dS^T``, each
    ``[B, Hk, G, n, C, Dv]``; where the state passes formed ``v_new`` or
    ``v_back = -kt dS^T`` (:func:`._passes.state_pass`'s ``values``), from those."""
    if v_new is None:
        v_new = p.u - matmul(p.w, s.swapaxes(-1, -2))
    d_vnew = matmul(p.p.swapaxes(-1, -2), d_o)
    if v_back is None:
        d_vnew = d_vnew + matmul(p.kt, d_s.swapaxes(-1, -2))
    else:
        d_vnew = d_vnew - v_back
    return v_new, d_vnew


def _group_backward_arrays(
    p: dict, xs, s, d_s, d_o, scale: float, v_new=None, v_back=None
) -> list[mx.array]:
    """Input gradients of one group, given its preparation ``p``, raw inputs ``xs``,
    the states entering its chunks ``s`` and the cotangents of the states leaving them
    ``d_s`` (both ``[B, Hk, G, n, Dv, Dk]``) and the output cotangent ``d_o``
    (``[B, Hk, G, n, C, Dv]``); ``v_new``, ``v_back`` as :func:`_state_terms`'s.
    Returns ``[dq, dk, dv, dg, dbeta]`` in chunk layout and the dtypes of ``xs``."""
    p = SimpleNamespace(**p, scale=scale)
    C = p.a.shape[-1]
    causal, strict = _causal(C), _strict(C)

    # Per-chunk gradients given the states (o = qg S^T + p v_new, v_new = u - w S^T,
    # S_next = decay S + v_new^T kt).
    v_new, d_vnew = _state_terms(p, s, d_s, d_o, v_new, v_back)  # d_vnew: also d_u
    d_w = -matmul(d_vnew, s)
    d_qg = matmul(d_o, s)
    d_p = mx.where(causal, matmul(d_o, v_new.swapaxes(-1, -2)), 0.0)
    d_kt = matmul(v_new, d_s)
    d_decay = mx.sum(d_s * s, axis=(-2, -1))

    # Back through the preparation.
    at = p.a.swapaxes(-1, -2)
    d_kb = matmul(at, d_w)
    d_vb = matmul(at, d_vnew)
    d_a = matmul(d_w, p.kb.swapaxes(-1, -2)) + matmul(d_vnew, p.vb.swapaxes(-1, -2))
    d_l = mx.where(strict, -matmul(matmul(at, d_a), at), 0.0)  # X = (I + L)^-1: dL = -X^T dX X^T
    kdkb = mx.sum(d_kb * p.k, axis=-1)
    beta_i = p.beta[..., :, None]
    d_beta = mx.sum(d_vb * p.v, axis=-1) + p.gamma * kdkb + mx.sum(d_l * p.gam * p.kk, axis=-1)
    d_gamma = p.scale * mx.sum(d_qg * p.q, axis=-1) + p.beta * kdkb
    d_gam = mx.where(strict, p.scale * d_p * p.qk + d_l * beta_i * p.kk, 0.0)
    d_qk = mx.sum(p.scale * d_p * p.gam, axis=2, keepdims=True)
    d_kk = mx.sum(d_l * beta_i * p.gam, axis=2, keepdims=True)
    d_q = mx.sum(d_qg * (p.scale * p.gamma)[..., None], axis=2, keepdims=True) + matmul(d_qk, p.k)
    d_k = (
        matmul(d_qk.swapaxes(-1, -2), p.q)
        + matmul(d_kk + d_kk.swapaxes(-1, -2), p.k)
        + mx.sum(d_kt * p.to_end[..., None] + d_kb * (p.beta * p.gamma)[..., None], axis=2,
                 keepdims=True)
    )  # fmt: skip
    d_to_end = mx.sum(d_kt * p.k, axis=-1)
    d_v = d_vb * p.beta[..., None]

    # Gates, each term a sum of exactly the spans it covers (no cancellation):
    # gam[i, j] spans g_{j+1..i}, gamma_i g_{0..i}, to_end_j g_{j+1..}, decay all.
    spans = mx.cumsum(d_gam * p.gam, axis=-2, reverse=True)  # [l, j]: sum over i >= l
    d_g = mx.sum(mx.where(strict, spans, 0.0), axis=-1)  # ... and over j < l
    d_g = d_g + mx.cumsum(d_gamma * p.gamma, axis=-1, reverse=True)
    d_g = d_g + mx.cumsum(d_to_end * p.to_end, axis=-1, inclusive=False)
    d_g = d_g + (d_decay * p.decay)[..., None]

    return _input_layout(xs, d_q, d_k, d_v, d_g, d_beta)


def _input_layout(xs, d_q, d_k, d_v, d_g, d_beta) -> list[mx.array]:
    """Group gradients (``[B, Hk, 1 or G, n, C, ...]``) in the chunk layout and dtypes
    of the raw inputs ``xs``; inputs that were read as zero (non-finite) get none."""
    q, k, v, g, beta = xs
    B, n, C, Hk = q.shape[:4]
    key_layout = [d.reshape(B, Hk, n, C, -1).transpose(0, 2, 3, 1, 4) for d in (d_q, d_k)]
    d_v = d_v.transpose(0, 3, 4, 1, 2, 5).reshape(v.shape)
    d_g = d_g.transpose((0, 3, 4, 1, 2, 5)[: d_g.ndim]).reshape(g.shape)
    d_beta = d_beta.transpose(0, 3, 4, 1, 2).reshape(beta.shape)
    read = (
        finite_mask(q), finite_mask(k), finite_mask(v), gate_ok(g), finite_mask(beta),
    )  # fmt: skip
    return [
        mx.where(ok, d, 0.0).astype(x.dtype)
        for ok, d, x in zip(read, [*key_layout, d_v, d_g, d_beta], xs)
    ]


# Compile the per-group functions (fewer, fused ops). This takes effect in forward-only
# calls only: under mx.grad / mx.vjp the inputs are tracers, and mx.compile then runs
# the plain function (docs/gated_delta.md).
_COMPILE_GROUPS = True
_COMPILED: dict = {}


def _compiled(fn):
    """``mx.compile(fn)``, made once per function and, on the CPU, per thread count:
    :func:`~chunkscan.ops._cpu_threads.matmul` reads ``CHUNKSCAN_CPU_THREADS`` when
    the function traces, and one trace per function kept the first call's count for
    the whole process."""
    key = (fn, threads() if mx.default_device() == mx.cpu else 0)
    if key not in _COMPILED:

        def traced(*args):  # a function of its own: MLX keeps traces by the function's id
            return fn(*args)

        _COMPILED[key] = mx.compile(traced)
    return _COMPILED[key]


@functools.cache
def _triangle(C: int, offset: int) -> mx.array:
    """``[C, C]`` bool, True where ``j - i <= offset`` (row ``i``, column ``j``). Built
    from Python data once per shape (``mx.tril`` is four ops at every call, per group,
    forward and backward); an array with data and no graph, so a compiled trace can
    capture it as a constant."""
    return mx.array([[j - i <= offset for j in range(C)] for i in range(C)], dtype=mx.bool_)


def _causal(C: int) -> mx.array:
    return _triangle(C, 0)


def _strict(C: int) -> mx.array:
    return _triangle(C, -1)


def _non_finite_reach(
    spec: Spec, q, k, v, g, beta: mx.array | None, kernel: bool = False
) -> tuple[mx.array, mx.array]:
    """Where the per-step recurrence has NaN from non-finite input: ``(o_bad [B, T, Hv],
    seq_bad [n_seq, Hv])``, both bool.

    The chunk form reads non-finite inputs as zero (so that the masked, upper-triangle
    parts of its products never turn ``0 * inf`` into NaN for earlier tokens) and puts
    the NaN back where the loop has it: every output from the first token with a
    non-finite ``k``, ``v``, ``beta`` or ``g`` (NaN or ``+inf``) of its sequence on,
    ``o[t]`` where ``q[t]`` is non-finite, and the final state of such a sequence.
    The masks are constants: the gradients of the other tokens are untouched.
    ``kernel``: two CUDA launches where they apply (:func:`._rows_cuda.non_finite_rows`
    flags the rows, :func:`._rows_cuda.non_finite_reach` spreads them along each
    sequence) instead of about twenty MLX ops; the same masks. ``beta=None``: an op
    without it (:func:`chunkscan.linear_attention`), the MLX ops only.
    """
    B, T, Hk, G, Hv = spec.B, spec.T, spec.Hk, spec.G, spec.Hv
    # Without stop_gradient, autodiff would build the (zero) vjp of every comparison:
    # one input-sized zero buffer per input, measured ~3 KiB per token here.
    q, k, v, g = (mx.stop_gradient(x) for x in (q, k, v, g))

    def per_value_head(bad_k):  # [B, T, Hk] -> [B, T, Hv]
        return mx.broadcast_to(bad_k[..., None], (B, T, Hk, G)).reshape(B, T, Hv)

    # Boolean algebra through mx.logical_*, not | and ~: under mx.vmap with one operand
    # unmapped, MLX 0.32.4's bitwise_or / bitwise_and read garbage (all-False inputs
    # gave True), which turned whole outputs NaN; the logical ops are right.
    if kernel and beta is not None and _rows_cuda.rows_supported(B, Hk, G):
        flagged, q_bad = _rows_cuda.non_finite_rows(q, k, v, g, mx.stop_gradient(beta))
        return _rows_cuda.non_finite_reach(flagged, q_bad, spec.seqs)
    g_bad = mx.logical_not(gate_ok(g))
    if spec.channel:
        g_bad = mx.any(g_bad, axis=-1)
    flags = [per_value_head(bad_rows(k)), bad_rows(v), g_bad]
    if beta is not None:
        flags.append(non_finite_mask(mx.stop_gradient(beta)))
    state_bad = functools.reduce(mx.logical_or, flags)
    # Counted along a contiguous axis: MLX's CUDA scan along a strided axis (T here,
    # of stride Hv) runs one thread per column, 0.64-0.66 ms at T = 16384 on an H200
    # (ncu, runs 23 and 25; a transposed view alone still takes that path), where
    # the copy and a row scan take 12 us (run 26).
    flagged = mx.contiguous(state_bad.astype(mx.int32).swapaxes(1, 2))  # [B, Hv, T]
    return _reach(flagged, per_value_head(bad_rows(q)), spec.seqs)


def _reach(
    bad_rows: mx.array, q_bad: mx.array, seqs: tuple[tuple[int, int], ...] | None
) -> tuple[mx.array, mx.array]:
    """:func:`._rows_cuda.non_finite_reach` in MLX ops (same arguments and results):
    ``bad_rows [B, Hv, T]`` int32 counted along ``T`` within each sequence."""
    B, Hv, _ = bad_rows.shape
    count = mx.cumsum(bad_rows, axis=-1).swapaxes(1, 2)
    if seqs is not None:
        # Count within each sequence: subtract the count before its first token.
        before = [lo for lo, hi in seqs for _ in range(hi - lo)]
        padded = mx.concatenate([mx.zeros((B, 1, Hv), dtype=mx.int32), count], axis=1)
        count = count - mx.take(padded, mx.array(before, dtype=mx.int32), axis=1)
        last = mx.array([hi - 1 for _, hi in seqs], dtype=mx.int32)
        seq_bad = mx.take(count, last, axis=1)[0] > 0
    else:
        seq_bad = count[:, -1] > 0
    o_bad = mx.logical_or(count > 0, q_bad)
    return o_bad, seq_bad
