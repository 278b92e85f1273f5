"""Sequence-mixing ops built on chunkscan's ordered, chunked backward: one subpackage
per op (:mod:`chunkscan.ops.gated_delta`, :mod:`chunkscan.ops.attention`,
:mod:`chunkscan.ops.linear_attention`, :mod:`chunkscan.ops.selective_scan`,
:mod:`chunkscan.ops.dplr_delta`, :mod:`chunkscan.ops.diagonal`), each its fast form
beside its naive oracle. The ops themselves are exported by :mod:`chunkscan`.

Nothing is re-exported here: ``from .attention import attention`` had bound
``chunkscan.ops.attention`` to the function, so the documented module path of the
knobs (``import chunkscan.ops.attention.blocked``) raised ``ImportError`` (found by
probing)."""
