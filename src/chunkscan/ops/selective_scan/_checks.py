"""The checks of :func:`selective_scan` and its oracle: shapes, dtypes, chunk size."""

from __future__ import annotations

import mlx.core as mx

from ...split import check_chunk_size
from .._checks import check_arrays, check_float_dtypes, shape

F32 = mx.float32
LAYOUT = (
    "x, dt [B, T, Dc]; A [Dc, N]; B, C [B, T, N]; D [Dc]; initial_state [B, Dc, N] "
    "(mlx-lm's Mamba layout: channels last)"
)


def check_inputs(fn, x, dt, A, B, C, D, initial_state, chunk_size) -> tuple[int, int, int, int]:
    """``(batch, T, Dc, N)`` of valid inputs; a ``TypeError`` / ``ValueError`` naming
    the argument, what it got and the layout otherwise."""
    named = {"x": x, "dt": dt, "A": A, "B": B, "C": C}
    optional = {"D": D, "initial_state": initial_state}
    check_arrays(fn, {**named, **{k: v for k, v in optional.items() if v is not None}})
    check_chunk_size(fn, chunk_size, example=8)
    check_float_dtypes(fn, {**named, **optional})
    if x.ndim != 3:
        raise ValueError(
            f"[{fn}] x must have 3 dimensions [B, T, Dc] but got shape {shape(x)}. "
            "Reshape x to [B, T, Dc]."
        )
    b, t, dc = shape(x)
    if A.ndim != 2 or A.shape[0] != dc:
        raise ValueError(
            f"[{fn}] A must have shape [Dc, N] = [{dc}, N] for x of shape {shape(x)} but got "
            f"{shape(A)}. The layout: {LAYOUT}."
        )
    n = A.shape[1]
    expected = {
        "dt": (b, t, dc),
        "A": (dc, n),
        "B": (b, t, n),
        "C": (b, t, n),
        "D": (dc,),
        "initial_state": (b, dc, n),
    }
    for name, a in {**named, **optional}.items():
        if name in ("x", "A") or a is None:
            continue
        if shape(a) != expected[name]:
            raise ValueError(
                f"[{fn}] {name} must have shape {list(expected[name])} for x of shape "
                f"{shape(x)} and A of shape {shape(A)} but got {shape(a)}. The layout: {LAYOUT}."
            )
    return b, t, dc, n
