"""Softmax attention: the blocked op and its float32 oracle.

- :func:`attention`: query blocks against the keys they need, a hand-written
  blockwise backward (FlashAttention-2), memory flat in the sequence length.
- :func:`naive_attention`: the whole score matrix in float32 (test oracle).
"""

from .blocked import attention, plan_blocks
from .naive import naive_attention

__all__ = ["attention", "naive_attention", "plan_blocks"]
