"""The checks of :func:`linear_attention` and its oracle: the Gated DeltaNet op's (the
same layouts, no ``beta``), a gate per head only."""

from __future__ import annotations

import mlx.core as mx

from ..gated_delta._checks import NO_BETA, Spec
from ..gated_delta._checks import check_inputs as _check_gdn_inputs

F32 = mx.float32


def check_inputs(fn, q, k, v, g, scale, initial_state, chunk_size) -> tuple[Spec, mx.array]:
    """The checked shapes and the gate: ``g`` as given, or zeros ``[B, T, Hv]`` (no
    decay) for ``g=None``."""
    if g is None:  # (a v of another rank keeps its own error: it is checked first)
        ok = isinstance(v, mx.array) and v.ndim == 4
        g = mx.zeros(tuple(v.shape[:3]) if ok else (0, 0, 0), dtype=F32)
    elif isinstance(g, mx.array) and g.ndim != 3:  # (Gated DeltaNet's message offers 4)
        per_channel = ": per-channel gates are not supported here" if g.ndim == 4 else ""
        raise ValueError(
            f"[{fn}] g must have 3 dimensions [B, T, Hv] (one log-decay per token and "
            f"value head) but got shape {tuple(g.shape)}{per_channel}. Pass one gate per "
            f"token and head (a constant decay per head: mx.broadcast_to(decay, (B, T, Hv)))."
        )
    note = (
        "Note the layout: value dim before key dim (mlx-lm's recurrent_gla keeps its state "
        "key dim first: pass h.swapaxes(-1, -2))."
    )
    spec = _check_gdn_inputs(
        fn, q, k, v, g, NO_BETA, scale, initial_state, chunk_size, None, state_note=note
    )
    return spec, g
