"""Argument checks that every op shares (the ops' own modules check their shapes).

Every message names the function in brackets, the rule, the value it got and a fix.
Nothing here uses ``assert``: user input is always checked with an explicit raise.
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx

from ..split import np_bool

F32_MAX = float(mx.finfo(mx.float32).max)  # the largest finite float32

FLOAT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
DTYPE_NAMES = "float32, bfloat16 or float16"


def shape(x: mx.array) -> tuple[int, ...]:
    return tuple(x.shape)


def check_arrays(fn: str, named: dict[str, object]) -> None:
    """Each value is an ``mx.array``. (``None`` is told it is required: ``mx.array(None)``
    is no fix; review, session 51.)"""
    for name, x in named.items():
        if x is None:
            raise TypeError(
                f"[{fn}] {name} must be an mx.array but got None: {name} is required "
                f"here. Pass the array."
            )
        if not isinstance(x, mx.array):
            raise TypeError(
                f"[{fn}] {name} must be an mx.array but got {type(x).__name__}. "
                f"Wrap it with mx.array(...)."
            )


def check_float_dtypes(fn: str, named: dict[str, mx.array | None]) -> None:
    """Each array of ``named`` (``None``: an optional argument left out) is floating
    (:data:`FLOAT_DTYPES`)."""
    for name, x in named.items():
        if x is not None and x.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"[{fn}] {name} must have dtype {DTYPE_NAMES} but got {x.dtype}. "
                + dtype_fix(name, x.dtype)
            )


def dtype_fix(name: str, dtype: mx.Dtype) -> str:
    """The fix for an array ``name`` of a dtype outside :data:`FLOAT_DTYPES`: a cast,
    except for complex numbers, which a cast would silently make real (found by
    probing: LRU's complex decays through ``diagonal_recurrence``; the message
    suggested that cast)."""
    if mx.issubdtype(dtype, mx.complexfloating):
        return (
            "Complex numbers are not supported: a cast to a real dtype would drop the "
            "imaginary part and compute something else without an error. Use real inputs."
        )
    return f"Cast it with {name}.astype(mx.float32) (or bfloat16/float16)."


def check_dtypes(fn: str, named: dict[str, mx.array]) -> None:
    """Each array is floating (:data:`FLOAT_DTYPES`), and ``q``, ``k``, ``v`` share one."""
    check_float_dtypes(fn, named)
    q, k, v = named["q"], named["k"], named["v"]
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"[{fn}] q, k and v must share one dtype but got q {q.dtype}, k {k.dtype} and "
            f"v {v.dtype}. Cast them to one dtype; the output has that dtype."
        )


def check_scale(fn: str, scale: object, example: float, *, none_ok: bool, why: str) -> float | None:
    """``scale`` as a Python float: it must be a finite real number (a NumPy scalar
    too; not a bool), or ``None`` where ``none_ok`` (returned as is); ``example`` and
    ``why`` make the fix in the message (``scale={example}`` + ``why``)."""
    if scale is None and none_ok:
        return None
    if isinstance(scale, (bool, np_bool())) or not isinstance(scale, numbers.Real):
        kind = "a real number (a Python float or int, a NumPy scalar)"
        kind += " or None" if none_ok else ""
        raise TypeError(
            f"[{fn}] scale must be {kind} but got {type(scale).__name__}. "
            f"Pass e.g. scale={example:.6g} {why}."
        )
    try:
        value = float(scale)
    except OverflowError:  # an int past float's range
        value = math.inf
    if not math.isfinite(value):
        shown = scale  # an int past float's range: not its hundreds of digits (and str()
        if isinstance(scale, numbers.Integral):  # raises past 4300 of them; review)
            shown = "an integer past float's range"
        raise ValueError(
            f"[{fn}] scale must be finite but got {shown}: every output would be NaN or "
            f"inf. Pass e.g. scale={example:.6g} {why}."
        )
    if abs(value) > F32_MAX:  # finite in Python, inf once the op casts it to float32
        raise ValueError(
            f"[{fn}] scale must be finite in float32 (at most {F32_MAX:.7g} in size) but "
            f"got {scale}: every output would be NaN or inf. Pass e.g. "
            f"scale={example:.6g} {why}."
        )
    return value


def check_bool(fn: str, name: str, value: object) -> None:
    """``value`` is a bool or NumPy bool (a string such as ``"no"`` would otherwise read
    as True)."""
    if not isinstance(value, (bool, np_bool())):
        raise TypeError(
            f"[{fn}] {name} must be True or False but got {value!r} ({type(value).__name__}). "
            f"Pass {name}=False to turn it off."
        )
