"""Linear attention with a scalar decay per head and token (plain, RetNet's, Lightning
attention's): the chunked op and its per-step oracle.

- :func:`linear_attention`: chunkwise, through :func:`chunkscan.scan` (the states
  entering the chunks plus one chunk's recomputation in the backward).
- :func:`naive_recurrent_linear_attention`: the per-step float32 loop (test oracle).
"""

from .chunk import linear_attention
from .naive import naive_recurrent_linear_attention

__all__ = ["linear_attention", "naive_recurrent_linear_attention"]
