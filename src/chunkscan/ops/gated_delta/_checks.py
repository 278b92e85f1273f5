"""Argument checks shared by the chunked op and the naive oracle.

Every message names the function in brackets, the rule, the value it got and a fix.
Nothing here uses ``assert``: user input is always checked with an explicit raise.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import mlx.core as mx

from ...split import check_chunk_size, is_numpy_array, np_bool
from .._checks import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    check_arrays,
    check_bool,
    check_dtypes,
    check_scale,
    dtype_fix,
)
from .._checks import shape as _shape


@dataclass(frozen=True)
class Spec:
    """Checked shapes of one call."""

    B: int
    T: int
    Hk: int
    Hv: int
    Dk: int
    Dv: int
    scale: float
    chunk_size: int
    seqs: tuple[tuple[int, int], ...] | None  # (start, end) per packed sequence
    channel: bool = False  # g is per key channel, [B, T, Hv, Dk]

    @property
    def G(self) -> int:
        return self.Hv // self.Hk if self.Hk else 1

    @property
    def empty(self) -> bool:
        """Whether any of ``B, T, Hk, Hv, Dk, Dv`` is zero (see :func:`empty_result`)."""
        return min(self.B, self.T, self.Hk, self.Hv, self.Dk, self.Dv) == 0

    @property
    def n_states(self) -> int:
        """How many initial/final states: one per batch row or per packed sequence."""
        return self.B if self.seqs is None else len(self.seqs)


#: ``check_inputs``' ``beta`` for an op that has none (``linear_attention``).
NO_BETA = object()


def check_inputs(
    fn: str,
    q: object,
    k: object,
    v: object,
    g: object,
    beta: object,
    scale: object,
    initial_state: object,
    chunk_size: object,
    cu_seqlens: object,
    *,
    normalize_qk: object = False,
    state_note: str = "Note the layout: value dim before key dim, as in mlx-lm.",
) -> Spec:
    """Check every argument; return the shapes. Raises ``TypeError``/``ValueError``.
    ``beta=NO_BETA``: an op with no ``beta`` (:func:`chunkscan.linear_attention`, which
    gives its own ``state_note``, the end of a wrong ``initial_state`` shape's message).
    A ``beta`` of ``None`` is refused as any other non-array (it was read as that op's
    case, and failed later with an ``AttributeError``; found by probing, session 51)."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if beta is NO_BETA:
        del named["beta"]
    check_arrays(fn, named)
    check_bool(fn, "normalize_qk", normalize_qk)
    for name, ndim, layout in (
        ("q", 4, "[B, T, Hk, Dk]"),
        ("k", 4, "[B, T, Hk, Dk]"),
        ("v", 4, "[B, T, Hv, Dv]"),
        ("g", 3, "[B, T, Hv]"),
        ("beta", 3, "[B, T, Hv]"),
    ):
        if name not in named:
            continue
        x = named[name]
        if name == "g" and x.ndim == 4:
            continue  # a per-channel gate [B, T, Hv, Dk], checked below
        if name == "g" and x.ndim != ndim:
            raise ValueError(
                f"[{fn}] g must have 3 dimensions [B, T, Hv] (one gate per head) or 4 "
                f"[B, T, Hv, Dk] (one per key channel) but got shape {_shape(x)}. Reshape g "
                f"to [B, T, Hv] or [B, T, Hv, Dk]."
            )
        if x.ndim != ndim:
            raise ValueError(
                f"[{fn}] {name} must have {ndim} dimensions {layout} but got shape "
                f"{_shape(x)}. Reshape {name} to {layout}."
            )
    check_dtypes(fn, named)
    B, T, Hk, Dk = _shape(q)
    if _shape(k) != _shape(q):
        raise ValueError(
            f"[{fn}] k must have the shape of q [B, T, Hk, Dk] but q has shape {_shape(q)} "
            f"and k has shape {_shape(k)}. Pass q and k with the same shape."
        )
    Bv, Tv, Hv, Dv = _shape(v)
    if (Bv, Tv) != (B, T):
        raise ValueError(
            f"[{fn}] v must have the batch size and length of q (B={B}, T={T}) but got "
            f"shape {_shape(v)}. Pass v as [B, T, Hv, Dv] with B={B} and T={T}."
        )
    heads_ok = Hv % Hk == 0 if Hk else Hv == 0  # Hk = 0 (nothing to compute) needs Hv = 0
    if not heads_ok:
        raise ValueError(
            f"[{fn}] the number of value heads Hv must be a multiple of the number of key "
            f"heads Hk but got Hv={Hv} (v shape {_shape(v)}) and Hk={Hk} (q shape "
            f"{_shape(q)}). Value head h uses key head h // (Hv // Hk); pass Hv = m * Hk."
        )
    channel = g.ndim == 4
    if channel and _shape(g) != (B, T, Hv, Dk):
        raise ValueError(
            f"[{fn}] a per-channel g must have shape [B, T, Hv, Dk] = {(B, T, Hv, Dk)} but "
            f"got {_shape(g)}. Pass one log-decay per token, value head and key channel."
        )
    for name in ("beta",) if channel else ("g", "beta"):
        if name not in named:
            continue
        x = named[name]
        if _shape(x) != (B, T, Hv):
            raise ValueError(
                f"[{fn}] {name} must have shape [B, T, Hv] = {(B, T, Hv)} but got "
                f"{_shape(x)}. Pass one {name} value per token and value head."
            )
    default_scale = Dk**-0.5 if Dk else 1.0  # Dk = 0: every product with q is empty
    scale = check_scale(fn, scale, default_scale, none_ok=True, why="(the default, Dk ** -0.5)")
    if scale is None:
        scale = default_scale
    chunk_size = check_chunk_size(fn, chunk_size, example=64)
    seqs = _check_cu_seqlens(fn, cu_seqlens, B, T)
    n_states = B if seqs is None else len(seqs)
    if initial_state is not None:
        if not isinstance(initial_state, mx.array):
            raise TypeError(
                f"[{fn}] initial_state must be an mx.array or None but got "
                f"{type(initial_state).__name__}. Wrap it with mx.array(...)."
            )
        want = (n_states, Hv, Dv, Dk)
        if _shape(initial_state) != want:
            per = "batch row" if seqs is None else "packed sequence"
            raise ValueError(
                f"[{fn}] initial_state must have shape [N, Hv, Dv, Dk] = {want} (one state "
                f"per {per}) but got {_shape(initial_state)}. {state_note}"
            )
        if initial_state.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"[{fn}] initial_state must have dtype {DTYPE_NAMES} but got "
                f"{initial_state.dtype}. " + dtype_fix("initial_state", initial_state.dtype)
            )
    return Spec(B, T, Hk, Hv, Dk, Dv, float(scale), chunk_size, seqs, channel)


# What each malformed cu_seqlens is told (found by probing, session 50: they named none).
_OFFSETS_FIX = (
    "Pass the sequences' start offsets and the total as whole numbers, e.g. "
    "cu_seqlens=[0, 5, 12] (an mx.array's .tolist() gives them; cast floats to int)."
)


def _check_cu_seqlens(
    fn: str, cu_seqlens: object, B: int, T: int
) -> tuple[tuple[int, int], ...] | None:
    if cu_seqlens is None:
        return None
    if is_numpy_array(cu_seqlens):
        if cu_seqlens.dtype.kind not in "iu":  # named before MLX's conversion renames it
            raise ValueError(
                f"[{fn}] cu_seqlens must be a 1-D integer array or a list of ints but got "
                f"a NumPy array of dtype {cu_seqlens.dtype}. {_OFFSETS_FIX}"
            )
        cu_seqlens = mx.array(cu_seqlens)  # read as MLX's
    if isinstance(cu_seqlens, mx.array):
        if cu_seqlens.ndim != 1 or not mx.issubdtype(cu_seqlens.dtype, mx.integer):
            raise ValueError(
                f"[{fn}] cu_seqlens must be a 1-D integer array or a list of ints but got "
                f"shape {_shape(cu_seqlens)} and dtype {cu_seqlens.dtype}. {_OFFSETS_FIX}"
            )
        try:
            offsets = [int(x) for x in cu_seqlens.tolist()]
        except (RuntimeError, ValueError) as e:  # a traced array (mx.compile, mx.vmap)
            raise TypeError(
                f"[{fn}] cu_seqlens is static (it fixes how tokens map onto chunks) and "
                f"is read with .tolist(), but this mx.array cannot be read here: it is "
                f"an input of a transformed function such as mx.compile ({e}). Pass "
                f"cu_seqlens as a Python list of ints, e.g. cu_seqlens=[0, 5, 12] "
                f"(mx.compile retraces for each new list)."
            ) from e
    elif isinstance(cu_seqlens, (list, tuple)) and all(
        isinstance(x, numbers.Integral) and not isinstance(x, (bool, np_bool())) for x in cu_seqlens
    ):
        offsets = [int(x) for x in cu_seqlens]  # NumPy integers too
    else:
        raise TypeError(
            f"[{fn}] cu_seqlens must be a list of ints, a 1-D integer mx.array or None but "
            f"got {cu_seqlens!r}. {_OFFSETS_FIX}"
        )
    if B != 1:
        raise ValueError(
            f"[{fn}] packed sequences (cu_seqlens) need batch size B = 1 but got B={B}. "
            f"Concatenate the sequences along T into one row."
        )
    ok = (
        len(offsets) >= 2
        and offsets[0] == 0
        and offsets[-1] == T
        and all(a < b for a, b in zip(offsets, offsets[1:]))
    )
    if not ok:
        if T == 0:
            raise ValueError(
                f"[{fn}] cu_seqlens={offsets} packs sequences into T=0 tokens, but each "
                f"sequence must hold at least one token. Pass cu_seqlens=None."
            )
        like = f"[0, {T}]" if T < 2 else f"[0, {T // 2}, {T}]"
        raise ValueError(
            f"[{fn}] cu_seqlens must be strictly increasing offsets from 0 to T={T}, like "
            f"{like}, but got {offsets}. Each sequence must hold at least one token."
        )
    return tuple((a, b) for a, b in zip(offsets, offsets[1:]))


def empty_result(
    spec: Spec, q: mx.array, initial_state: mx.array | None
) -> tuple[mx.array, mx.array] | None:
    """``(o, final_state)`` of a call with a zero-size dimension, else ``None``.

    With any of ``B, T, Hk, Hv, Dk, Dv`` zero there is nothing to compute: ``o`` is
    zeros ``[B, T, Hv, Dv]`` in the dtype of ``q`` (also for ``Dk = 0`` with ``T > 0``:
    the state ``[Dv, 0]`` is empty, so every output is an empty sum), and the final
    state is ``initial_state`` in float32 (no step changes it; with ``T = 0`` its
    gradient passes through), or zeros ``[N, Hv, Dv, Dk]``.
    """
    if not spec.empty:
        return None
    o = mx.zeros((spec.B, spec.T, spec.Hv, spec.Dv), dtype=q.dtype)
    if initial_state is None:
        final = mx.zeros((spec.n_states, spec.Hv, spec.Dv, spec.Dk), dtype=mx.float32)
    else:
        final = initial_state.astype(mx.float32)
    return o, final
