"""The delta rule with a diagonal-plus-low-rank transition (RWKV-7): the chunked op and
its per-step oracle.

- :func:`dplr_delta_rule`: :func:`chunkscan.scan` over chunks, each chunk-parallel (a
  unit triangular solve for the low-rank reads), the backward MLX's autograd of one chunk.
- :func:`naive_recurrent_dplr_delta_rule`: the per-step float32 loop (test oracle).
"""

from .chunk import default_chunk_size, dplr_delta_rule
from .naive import naive_recurrent_dplr_delta_rule

__all__ = ["default_chunk_size", "dplr_delta_rule", "naive_recurrent_dplr_delta_rule"]
