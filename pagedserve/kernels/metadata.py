"""The attention metadata one forward pass needs, passed explicitly (never a global)."""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes a flat batch: decode tokens first (one per sequence), then prefill chunks.

    Prefill sequence i owns flat tokens ``num_decode_tokens + cu_seqlens_q[i]`` up to
    ``num_decode_tokens + cu_seqlens_q[i+1]``; they are the *last* query_len positions of
    its ``context_len`` keys (cached prefix + the new tokens).
    """

    slot_mapping: torch.Tensor  # [T] int64, -1 = write nothing
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    decode_context_lens: torch.Tensor  # [D] int32
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [P+1] int32
    prefill_context_lens: torch.Tensor  # [P] int32
    # The longest prefill chunk, known on the host: a GPU kernel's grid needs it, and reading
    # it back from cu_seqlens_q would stall the host on every layer. None where one CUDA
    # graph serves steps of any lengths: the "flash" kernel then sizes a flat grid from the
    # tensors' shapes (kernels/triton/prefill.py).
    prefill_max_query_len: int | None = None
