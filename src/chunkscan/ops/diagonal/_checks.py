"""The checks of :func:`diagonal_recurrence` and its oracle: shapes, dtypes, chunk size."""

from __future__ import annotations

import mlx.core as mx

from ...split import check_chunk_size
from .._checks import check_arrays, check_float_dtypes, shape

F32 = mx.float32
LAYOUT = "x, a [B, T, ...] (one shape); initial_state [B, ...] (x's shape without T)"


def check_inputs(fn, x, a, initial_state, chunk_size) -> tuple[int, ...]:
    """The shape of ``x`` for valid inputs; a ``TypeError`` / ``ValueError`` naming the
    argument, what it got and the layout otherwise."""
    named = {"x": x, "a": a}
    check_arrays(fn, named if initial_state is None else {**named, "initial_state": initial_state})
    check_chunk_size(fn, chunk_size, example=8)
    check_float_dtypes(fn, {**named, "initial_state": initial_state})
    if x.ndim < 2:
        raise ValueError(
            f"[{fn}] x must have at least 2 dimensions [B, T, ...] but got shape "
            f"{shape(x)}. Reshape x to [B, T, ...] (x[None] for one sequence of T steps). "
            f"The layout: {LAYOUT}."
        )
    if shape(a) != shape(x):
        raise ValueError(
            f"[{fn}] a must have x's shape {shape(x)} but got {shape(a)} (broadcast it "
            f"with mx.broadcast_to(a, x.shape) if that is what you mean). The layout: {LAYOUT}."
        )
    state = shape(x)[:1] + shape(x)[2:]
    if initial_state is not None and shape(initial_state) != state:
        raise ValueError(
            f"[{fn}] initial_state must have shape {list(state)} for x of shape {shape(x)} "
            f"but got {shape(initial_state)}. The layout: {LAYOUT}."
        )
    return shape(x)
