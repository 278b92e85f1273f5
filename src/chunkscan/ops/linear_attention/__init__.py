"""Linear attention with a scalar decay per head and token (plain, RetNet's, Lightning
attention's): the chunked op and its per-step oracle.

- :func:`linear_attention`: chunk-parallel in groups of chunks, the backward derived by
  hand (the state entering each group plus one group's recomputation).
- :func:`naive_recurrent_linear_attention`: the per-step float32 loop (test oracle).
"""

from .chunk import default_chunk_size, linear_attention
from .naive import naive_recurrent_linear_attention

__all__ = ["default_chunk_size", "linear_attention", "naive_recurrent_linear_attention"]
