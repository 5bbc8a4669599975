"""Paged-attention kernels: PyTorch references (CPU path) and Triton kernels (CUDA path)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class KernelSet:
    """The four kernels the model runner needs; both implementations share signatures."""

    store_kvcache: Callable[..., None]
    paged_prefill_attention: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]


REFERENCE = KernelSet(
    reference.store_kvcache,
    reference.paged_prefill_attention,
    reference.paged_decode_attention,
    reference.copy_blocks,
)


def kernels_for(device: torch.device) -> KernelSet:
    """Triton on CUDA, the PyTorch references everywhere else."""
    if device.type != "cuda":
        return REFERENCE
    from pagedserve.kernels import triton_kernels as tk

    return KernelSet(
        tk.store_kvcache, tk.paged_prefill_attention, tk.paged_decode_attention, tk.copy_blocks
    )


__all__ = ["AttentionMetadata", "KernelSet", "REFERENCE", "kernels_for"]
