"""Non-finite checks the ops share (Gated DeltaNet, linear attention): each in as few
MLX ops as the test allows, since on a GPU each elementwise op is a launch.

The chunk forms read non-finite input as zero (:func:`finite`, :func:`finite_gate`), so
that the masked, upper-triangle parts of their products never turn ``0 * inf`` into NaN
for earlier tokens, and put the NaN back where the per-step loop has it
(``gated_delta.chunk._non_finite_reach``).
"""

from __future__ import annotations

import math

import mlx.core as mx

# The non-finite checks run per group, forward and backward. Under mx.grad MLX runs the
# groups' compiled functions as plain ops (no fusion), so on a GPU each elementwise op
# is a launch of tens of microseconds: these use two ops where mx.isfinite takes six
# (two Equal, NotEqual, two LogicalOr, LogicalNot) and mx.zeros(()) one more.


def finite_mask(x: mx.array) -> mx.array:
    """``mx.isfinite(x)``: ``x - x`` is exactly 0 for every finite ``x`` and NaN for
    NaN and +-inf."""
    return (x - x) == 0


def non_finite_mask(x: mx.array) -> mx.array:
    """``~mx.isfinite(x)`` in two ops, as :func:`finite_mask`."""
    return (x - x) != 0


def bad_rows(x: mx.array) -> mx.array:
    """``[..., D] -> [...]``: True where a row holds a non-finite value. ``x - x`` is 0
    where finite and NaN elsewhere, so its row sum is exactly 0 or NaN: three launches
    (subtract, sum, compare on the small result) where ``~mx.all(mx.isfinite(x), -1)``
    takes eight."""
    return mx.sum(x - x, axis=-1) != 0


def gate_ok(g: mx.array) -> mx.array:
    """True where the gate is read as given: finite or ``-inf`` (a reset); False for
    NaN (every comparison with it is False) and ``+inf``."""
    return g < math.inf


def finite(x: mx.array) -> mx.array:
    """``x`` with every non-finite value replaced by zero."""
    return mx.where(finite_mask(x), x, 0.0)


def finite_gate(g: mx.array) -> mx.array:
    """``g`` with NaN and ``+inf`` replaced by zero (``-inf`` is a valid reset)."""
    return mx.where(gate_ok(g), g, 0.0)
