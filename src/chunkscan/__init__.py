"""chunkscan: chunked scans for MLX whose backward memory does not grow with T.

Public API:

- :func:`scan`: a chunked scan with a checkpointed, ordered backward.
- :func:`stepwise`: write the scanned function per step instead of per chunk.
- :func:`checkpoint`: a drop-in for ``mx.checkpoint`` in hand-written chunk loops.
- :func:`split`: chunking whose gradient is concatenated, not summed (one concatenate
  up to 16 pieces; above that a tree, each level of which copies the gradient once).
- :func:`gated_delta_rule`: the Gated DeltaNet recurrence, chunkwise, with a
  hand-written backward (see :mod:`chunkscan.ops.gated_delta`).
- :func:`attention`: softmax attention in query blocks with a backward whose memory
  does not grow with T (see :mod:`chunkscan.ops.attention`).
- :func:`linear_attention`: linear attention with a scalar decay per head and token,
  chunk-parallel with a hand-written backward (see :mod:`chunkscan.ops.linear_attention`).
- :func:`selective_scan`: Mamba's selective scan (a decay per channel and state index),
  chunked (see :mod:`chunkscan.ops.selective_scan`).
- :func:`diagonal_recurrence`: the elementwise linear recurrence ``h = a * h + x``
  (RecurrentGemma's RG-LRU), chunked (see :mod:`chunkscan.ops.diagonal`).
- :func:`dplr_delta_rule`: the delta rule with a diagonal-plus-low-rank transition
  (RWKV-7), chunked (see :mod:`chunkscan.ops.dplr_delta`).
"""

from ._compat import check_mlx as _check_mlx
from .checkpoint import checkpoint
from .ops.attention import attention, naive_attention
from .ops.diagonal import diagonal_recurrence, naive_diagonal_recurrence
from .ops.dplr_delta import dplr_delta_rule, naive_recurrent_dplr_delta_rule
from .ops.gated_delta import gated_delta_rule, naive_recurrent_gated_delta_rule
from .ops.linear_attention import linear_attention, naive_recurrent_linear_attention
from .ops.selective_scan import naive_selective_scan, selective_scan
from .scan import ClosureCaptureWarning, scan
from .split import split
from .stepwise import stepwise

_check_mlx()

__version__ = "0.1.0"

__all__ = [
    "ClosureCaptureWarning",
    "attention",
    "checkpoint",
    "diagonal_recurrence",
    "dplr_delta_rule",
    "gated_delta_rule",
    "linear_attention",
    "naive_attention",
    "naive_diagonal_recurrence",
    "naive_recurrent_dplr_delta_rule",
    "naive_recurrent_gated_delta_rule",
    "naive_recurrent_linear_attention",
    "naive_selective_scan",
    "scan",
    "selective_scan",
    "split",
    "stepwise",
]
