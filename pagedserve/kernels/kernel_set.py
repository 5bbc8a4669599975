"""KernelSet, the ops one backend provides, and the KV cache allocation its sets share.

Every cache a set allocates has the logical shape ``[num_layers, num_blocks, block_size,
num_kv_heads, head_dim]``; the memory order behind it is the set's choice, made for its
kernels."""

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kernels import reference


def kv_cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                   ) -> torch.Tensor:
    """Zeros for a KV cache. On Linux CPUs, in fresh memory advised to use transparent huge
    pages: decode reads scattered blocks across GBs, and with 4 KiB pages nearly every block
    is a TLB miss (huge pages made decode attention 1.2-1.35x faster here). Fresh because
    malloc may hand back heap pages already mapped small."""
    if device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # not shared memory: its THP is off
    memory = mmap.mmap(-1, max(1, math.prod(shape)) * dtype.itemsize, flags=private)
    memory.madvise(mmap.MADV_HUGEPAGE)
    cache = torch.frombuffer(memory, dtype=dtype).view(shape)  # keeps the mapping alive
    return cache.zero_()  # touch every page now, so the memory is committed up front


def block_major_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                         head_dim: int, dtype: torch.dtype, device: torch.device
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_caches, v_caches), contiguous: each block one run of memory, which is what a
    block copy (Triton's copy_blocks) needs."""
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return kv_cache_zeros(shape, dtype, device), kv_cache_zeros(shape, dtype, device)


@dataclass(frozen=True)
class KernelSet:
    """The ops the model and its runner need; every implementation shares the signatures
    of kernels/reference.py (paged_prefill_attention's max_query_len keyword included, and
    both attention ops' ``out``: write the result there, not into a new tensor)."""

    store_kvcache: Callable[..., None]
    paged_prefill_attention: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor] = reference.rms_norm
    rotary_: Callable[..., None] = reference.rotary_
    silu_and_mul: Callable[..., torch.Tensor] = reference.silu_and_mul
    argmax_rows: Callable[..., torch.Tensor] = reference.argmax_rows
    # (num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device) ->
    # (k_caches, v_caches), zeroed, in the memory layout this set's kernels read fastest.
    allocate_kv_cache: Callable[..., tuple[torch.Tensor, torch.Tensor]] = block_major_kv_cache
    # float32 CPU linears: weight [N, K] -> packed, and (x, packed, bias, N) -> x W^T + bias.
    # None: oneDNN packs them (models/llama.py's PackedLinear).
    pack_linear_f32: Callable[..., torch.Tensor] | None = None
    linear_f32: Callable[..., torch.Tensor] | None = None
    name: str = "reference"


REFERENCE = KernelSet(
    reference.store_kvcache,
    reference.paged_prefill_attention,
    reference.paged_decode_attention,
    reference.copy_blocks,
)
