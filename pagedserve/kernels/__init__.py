"""Kernels: PyTorch references (the semantics), C++ CPU kernels and Triton CUDA kernels."""

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class KernelSet:
    """The ops the model and its runner need; every implementation shares the signatures
    of kernels/reference.py."""

    store_kvcache: Callable[..., None]
    paged_prefill_attention: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor] = reference.rms_norm
    rotary_: Callable[..., None] = reference.rotary_
    silu_and_mul: Callable[..., torch.Tensor] = reference.silu_and_mul
    argmax_rows: Callable[..., torch.Tensor] = reference.argmax_rows
    # Whether the key cache must hold each block of each head d-major ([d, block_size]):
    # the layout the C++ decode kernel reads. The references accept any layout.
    key_blocks_d_major: bool = False
    name: str = "reference"


REFERENCE = KernelSet(
    reference.store_kvcache,
    reference.paged_prefill_attention,
    reference.paged_decode_attention,
    reference.copy_blocks,
)


def kernels_for(device: torch.device, dtype: torch.dtype, native: bool = True) -> KernelSet:
    """Triton on CUDA; on CPU the C++ kernels (float32/bfloat16) where they build
    (native=True), else the PyTorch references."""
    if device.type == "cuda":
        from pagedserve.kernels import triton_attention as ta
        from pagedserve.kernels import triton_kernels as tk

        return KernelSet(
            tk.store_kvcache, ta.paged_prefill_attention, ta.paged_decode_attention,
            tk.copy_blocks, name="triton")
    if native and device.type == "cpu":
        from pagedserve.kernels import cpu_ops

        ops = cpu_ops.load() if dtype in cpu_ops.DTYPES else None
        if ops is not None:
            return cpu_kernel_set(ops)
    return REFERENCE


def cpu_kernel_set(ops: ModuleType) -> KernelSet:
    """The set built on a loaded C++ extension (``cpu_ops.load()``, or another build of the
    same sources, as scripts/ab_cpu_kernels.py compares)."""
    from pagedserve.kernels import cpu_ops

    return dataclasses.replace(
        REFERENCE,
        store_kvcache=ops.store_kvcache,
        paged_decode_attention=cpu_ops.decode_attention(ops),
        paged_prefill_attention=functools.partial(
            reference.paged_prefill_attention, gather_kv=ops.gather_kv),
        rms_norm=ops.rms_norm,
        rotary_=ops.rope_,
        silu_and_mul=ops.silu_and_mul,
        argmax_rows=ops.argmax_rows,
        key_blocks_d_major=True,
        name="cpu-native",
    )


__all__ = ["AttentionMetadata", "KernelSet", "REFERENCE", "cpu_kernel_set", "kernels_for"]
