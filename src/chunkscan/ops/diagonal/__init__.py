"""The elementwise linear recurrence ``h_t = a_t * h_{t-1} + x_t`` (RecurrentGemma's
RG-LRU scan): the chunked op and its per-step oracle.

- :func:`diagonal_recurrence`: :func:`chunkscan.scan` over chunks, each a log-depth
  parallel scan (the carries between chunks plus one chunk's recomputation).
- :func:`naive_diagonal_recurrence`: the per-step float32 loop (test oracle).
"""

from .chunk import default_chunk_size, diagonal_recurrence, inclusive_scan
from .naive import naive_diagonal_recurrence

__all__ = [
    "default_chunk_size",
    "diagonal_recurrence",
    "inclusive_scan",
    "naive_diagonal_recurrence",
]
