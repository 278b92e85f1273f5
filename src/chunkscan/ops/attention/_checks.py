"""Argument checks shared by the blocked attention and its naive oracle.

Every message names the function in brackets, the rule, the value it got and a fix.
Nothing here uses ``assert``: user input is always checked with an explicit raise.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...split import check_chunk_size
from .._checks import FLOAT_DTYPES, check_arrays, check_dtypes, check_scale, dtype_fix
from .._checks import shape as _shape


@dataclass(frozen=True)
class Spec:
    """Checked shapes of one call.

    ``mask_kind`` is ``"none"``, ``"causal"``, ``"bool"`` or ``"additive"``; for an
    array mask ``mask_shape`` is its shape padded with leading ones to 4 dimensions.
    """

    B: int
    Hq: int
    Hkv: int
    T: int
    S: int
    D: int
    Dv: int
    scale: float
    mask_kind: str
    mask_shape: tuple[int, ...] | None
    chunk_size: int | None

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv

    @property
    def empty(self) -> bool:
        """No batch row, query or key: the result is zeros ``[B, Hq, T, Dv]`` (with
        ``S = 0`` every row sees no key), as ``mx.fast`` gives."""
        return self.B == 0 or self.T == 0 or self.S == 0


def empty_result(spec: Spec, q: mx.array) -> mx.array | None:
    """The output of a call with no batch row, query or key (:attr:`Spec.empty`),
    else ``None``; its gradients are zeros."""
    if not spec.empty:
        return None
    return mx.zeros((spec.B, spec.Hq, spec.T, spec.Dv), dtype=q.dtype)


def check_inputs(
    fn: str, q: object, k: object, v: object, scale: object, mask: object, chunk_size: object
) -> Spec:
    """Check every argument; return the shapes. Raises ``TypeError``/``ValueError``."""
    named = {"q": q, "k": k, "v": v}
    check_arrays(fn, named)
    for name, x in named.items():
        if x.ndim != 4:
            layout = "[B, Hq, T, D]" if name == "q" else "[B, Hkv, S, D]"
            raise ValueError(
                f"[{fn}] {name} must have 4 dimensions {layout} but got shape "
                f"{_shape(x)}. Transpose or reshape {name} to {layout} (heads before time)."
            )
    check_dtypes(fn, named)
    B, Hq, T, D = _shape(q)
    Bk, Hkv, S, Dk = _shape(k)
    if Bk != B or Dk != D:
        raise ValueError(
            f"[{fn}] k must have the batch size and head dimension of q (B={B}, D={D}) but "
            f"got shape {_shape(k)}. Pass k as [B, Hkv, S, D] with B={B} and D={D}."
        )
    Bv, Hv, Sv, Dv = _shape(v)
    if (Bv, Hv, Sv) != (B, Hkv, S):
        raise ValueError(
            f"[{fn}] v must have the batch size, heads and length of k (B={B}, Hkv={Hkv}, "
            f"S={S}) but got shape {_shape(v)}. Pass v as [B, Hkv, S, Dv]."
        )
    if Hq < 1:
        raise ValueError(
            f"[{fn}] q must hold at least one head but got Hq={Hq} (q shape {_shape(q)}). "
            "Pass q as [B, Hq, T, D] with Hq >= 1."
        )
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(
            f"[{fn}] the number of query heads Hq must be a multiple of the number of "
            f"key/value heads Hkv but got Hq={Hq} (q shape {_shape(q)}) and Hkv={Hkv} (k shape "
            f"{_shape(k)}). Query head h uses key/value head h // (Hq // Hkv); pass Hq = m * Hkv."
        )
    scale = check_scale(fn, scale, D**-0.5 if D else 1.0, none_ok=False, why="(1 / sqrt(D))")
    chunk_size = check_chunk_size(fn, chunk_size, example=256, none="for the automatic size")
    kind, mask_shape = _check_mask(fn, mask, q.dtype, (B, Hq, T, S))
    return Spec(B, Hq, Hkv, T, S, D, Dv, float(scale), kind, mask_shape, chunk_size)


def _check_mask(
    fn: str, mask: object, dtype: mx.Dtype, full: tuple[int, int, int, int]
) -> tuple[str, tuple[int, ...] | None]:
    if mask is None:
        return "none", None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(
                f"[{fn}] the only mask string is 'causal' but got {mask!r}. Pass "
                f"mask='causal', a boolean or additive mx.array, or None."
            )
        return "causal", None
    if not isinstance(mask, mx.array):
        raise TypeError(
            f"[{fn}] mask must be None, 'causal' or an mx.array but got "
            f"{type(mask).__name__}. Wrap it with mx.array(...)."
        )
    if mask.dtype == mx.bool_:
        kind = "bool"
    elif mask.dtype in FLOAT_DTYPES:
        kind = "additive"
    else:
        raise ValueError(
            f"[{fn}] an array mask must be boolean (True = attend) or floating (added to "
            f"the scores; float32, float16 or bfloat16) but got dtype {mask.dtype}. "
            f"{_mask_dtype_fix(mask.dtype, dtype)}"
        )
    shape = _shape(mask)
    ok = mask.ndim <= 4
    if ok:
        shape = (1,) * (4 - mask.ndim) + shape
        ok = all(m in (1, f) for m, f in zip(shape, full))
    if not ok:
        raise ValueError(
            f"[{fn}] mask must broadcast to [B, Hq, T, S] = {full} (each dimension 1 or "
            f"full, at most 4 dimensions) but got shape {_shape(mask)}. Pass a mask of "
            f"shape [T, S], [B, 1, T, S] or [B, Hq, T, S]."
        )
    return kind, shape


def _mask_dtype_fix(mask_dtype: mx.Dtype, dtype: mx.Dtype) -> str:
    """The fix for an array mask of a dtype the op does not take (``dtype``: q's). A
    floating mask (float64) is additive, so only a floating cast keeps it: the message
    offered ``mask.astype(mx.bool_)`` first, which reads an additive mask's 0 as masked
    and its ``-inf`` as attend, the mask inverted (found by probing, session 53). An
    integer mask (uint8, int32) may be a 0/1 mask or an additive one: both casts, each
    named. A complex one: no cast (:func:`dtype_fix`)."""
    if mx.issubdtype(mask_dtype, mx.complexfloating):
        return dtype_fix("mask", mask_dtype)
    if mx.issubdtype(mask_dtype, mx.floating):
        alt = "" if dtype == mx.float32 else f" (or mask.astype({_mx_name(dtype)}), q's dtype)"
        return (
            f"It is added to the scores: pass mask.astype(mx.float32){alt}, not a boolean "
            f"cast, which would read its 0 as masked and -inf as attend."
        )
    return (
        "Pass mask.astype(mx.bool_) for a 0/1 mask (nonzero = attend) or "
        "mask.astype(mx.float32) for an additive one (added to the scores)."
    )


def _mx_name(dtype: mx.Dtype) -> str:
    """``mlx.core.float16`` as ``mx.float16``."""
    return str(dtype).replace("mlx.core.", "mx.")
