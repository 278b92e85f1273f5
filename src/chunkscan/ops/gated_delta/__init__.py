"""Gated DeltaNet: the chunked op and its per-step oracle.

- :func:`gated_delta_rule`: chunkwise forward, hand-written chunk-by-chunk backward,
  bounded memory.
- :func:`naive_recurrent_gated_delta_rule`: the per-step float32 loop (test oracle).
"""

from .chunk import default_chunk_size, gated_delta_rule, unit_lower_inverse
from .naive import naive_recurrent_gated_delta_rule

__all__ = [
    "default_chunk_size",
    "gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
    "unit_lower_inverse",
]
