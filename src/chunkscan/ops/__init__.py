"""Sequence-mixing ops built on chunkscan's ordered, chunked backward."""

from .gated_delta import gated_delta_rule, naive_recurrent_gated_delta_rule

__all__ = ["gated_delta_rule", "naive_recurrent_gated_delta_rule"]
