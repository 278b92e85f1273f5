"""The checks of :func:`dplr_delta_rule` and its oracle: shapes, dtypes, chunk size."""

from __future__ import annotations

import mlx.core as mx

from ...split import check_chunk_size
from .._checks import check_arrays, check_dtypes, check_float_dtypes, shape

F32 = mx.float32
LAYOUT = (
    "q, k, a, b, g [B, T, H, Dk]; v [B, T, H, Dv]; initial_state [B, H, Dv, Dk] "
    "(gated_delta_rule's layout, one key head per value head)"
)


def check_inputs(fn, q, k, v, a, b, g, initial_state, chunk_size) -> tuple[int, int, int, int, int]:
    """``(batch, T, H, Dk, Dv)`` of valid inputs; a ``TypeError`` / ``ValueError``
    naming the argument, what it got and the layout otherwise."""
    named = {"q": q, "k": k, "v": v, "a": a, "b": b, "g": g}
    check_arrays(fn, named if initial_state is None else {**named, "initial_state": initial_state})
    check_chunk_size(fn, chunk_size, example=16)
    check_dtypes(fn, named)
    check_float_dtypes(fn, {"initial_state": initial_state})
    if q.ndim != 4:
        raise ValueError(
            f"[{fn}] q must have 4 dimensions [B, T, H, Dk] but got shape {shape(q)}. "
            "Reshape q to [B, T, H, Dk]."
        )
    batch, t, h, dk = shape(q)
    if v.ndim != 4 or shape(v)[:3] != (batch, t, h):
        raise ValueError(
            f"[{fn}] v must have shape [B, T, H, Dv] = [{batch}, {t}, {h}, Dv] for q of shape "
            f"{shape(q)} but got {shape(v)}. The layout: {LAYOUT}."
        )
    dv = v.shape[3]
    expected = {name: (batch, t, h, dk) for name in ("k", "a", "b", "g")}
    expected["initial_state"] = (batch, h, dv, dk)
    given = {"k": k, "a": a, "b": b, "g": g, "initial_state": initial_state}
    for name, x in given.items():
        if x is not None and shape(x) != expected[name]:
            raise ValueError(
                f"[{fn}] {name} must have shape {list(expected[name])} for q of shape "
                f"{shape(q)} and v of shape {shape(v)} but got {shape(x)}. The layout: {LAYOUT}."
            )
    return batch, t, h, dk, dv
