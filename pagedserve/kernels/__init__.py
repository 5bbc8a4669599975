"""Kernels: PyTorch references (the semantics), C++ CPU kernels (``kernels/cpu/``) and
Triton CUDA kernels (``kernels/triton/``). Each backend's package builds its KernelSet."""

import torch

from pagedserve.kernels.kernel_set import REFERENCE, KernelSet
from pagedserve.kernels.metadata import AttentionMetadata


def kernels_for(device: torch.device, dtype: torch.dtype, native: bool = True,
                triton_attention: str = "flash") -> KernelSet:
    """Triton on CUDA (with the ``triton_attention`` kernels); on CPU the C++ kernels
    (float32/bfloat16) where they build (native=True), else the PyTorch references."""
    # Imported here: Triton is optional, and the C++ loader only matters on CPU.
    if device.type == "cuda":
        from pagedserve.kernels import triton

        return triton.kernel_set(triton_attention)
    if native and device.type == "cpu":
        from pagedserve.kernels import cpu

        if dtype in cpu.DTYPES and (native_set := cpu.kernel_set()) is not None:
            return native_set
    return REFERENCE


__all__ = ["AttentionMetadata", "KernelSet", "REFERENCE", "kernels_for"]
