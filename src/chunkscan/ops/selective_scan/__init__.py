"""Mamba's selective state-space recurrence (a decay per channel and state index): the
chunked op and its per-step oracle.

- :func:`selective_scan`: :func:`chunkscan.scan` over chunks, each a log-depth parallel
  scan (the carries between chunks plus one chunk's recomputation in the backward).
- :func:`naive_selective_scan`: the per-step float32 loop (test oracle).
"""

from .chunk import default_chunk_size, selective_scan
from .naive import naive_selective_scan

__all__ = ["default_chunk_size", "naive_selective_scan", "selective_scan"]
