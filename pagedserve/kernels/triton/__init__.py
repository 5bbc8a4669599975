"""The Triton kernels, the CUDA path: paged attention (``decode``: split-KV flash-decoding;
``prefill``: tensor-core flash attention; ``attention`` re-exports both), the K/V store and
block copy (``cache_ops``), and what they share (``common``). Every import in the project is
absolute, so ``import triton`` in these modules is the Triton package, not this one."""

from pagedserve.kernels.kernel_set import KernelSet, block_major_kv_cache


def kernel_set() -> KernelSet:
    """The Triton set, on block-major caches (its block copy moves each block as one run)."""
    # Imported on use: triton is optional, and it reads TRITON_INTERPRET when a kernel
    # module is imported.
    from pagedserve.kernels.triton import cache_ops, decode, prefill

    return KernelSet(
        cache_ops.store_kvcache, prefill.paged_prefill_attention,
        decode.paged_decode_attention, cache_ops.copy_blocks,
        allocate_kv_cache=block_major_kv_cache, name="triton")
