"""The Triton kernels, the CUDA path: paged attention (``attention``), the K/V store and
block copy (``cache_ops``), and what they share (``common``). Every import in the project is
absolute, so ``import triton`` in these modules is the Triton package, not this one."""

from pagedserve.kernels.kernel_set import KernelSet, block_major_kv_cache


def kernel_set() -> KernelSet:
    """The Triton set, on block-major caches (its block copy moves each block as one run)."""
    # Imported on use: triton is optional, and it reads TRITON_INTERPRET when a kernel
    # module is imported.
    from pagedserve.kernels.triton import attention, cache_ops

    return KernelSet(
        cache_ops.store_kvcache, attention.paged_prefill_attention,
        attention.paged_decode_attention, cache_ops.copy_blocks,
        allocate_kv_cache=block_major_kv_cache, name="triton")
