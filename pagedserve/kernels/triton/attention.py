"""Triton paged attention, the CUDA path: decode (``decode``: one query per sequence,
split-KV) and prefill (``prefill``: chunks, with or without a cached prefix), with the
signatures and semantics of ``reference``. Conventions in ``common``."""

from pagedserve.kernels.triton.decode import paged_decode_attention
from pagedserve.kernels.triton.prefill import paged_prefill_attention

__all__ = ["paged_decode_attention", "paged_prefill_attention"]
