"""Sequence-mixing ops built on chunkscan's ordered, chunked backward."""

from .attention import attention, naive_attention
from .gated_delta import gated_delta_rule, naive_recurrent_gated_delta_rule

__all__ = ["attention", "gated_delta_rule", "naive_attention", "naive_recurrent_gated_delta_rule"]
