"""The Triton kernels, the CUDA path: paged attention in two versions, "flash" (the default;
``decode``: split-KV flash-decoding; ``prefill``: tensor-core flash attention) and "basic"
(``basic``, the first kernels, kept as the baseline the benchmarks measure against), the K/V
store and block copy (``cache_ops``), RMSNorm/RoPE/SwiGLU fused into one launch each
(``elementwise``, in the "flash" set), and what they share (``common``). Every import in the
project is absolute, so ``import triton`` in these modules is the Triton package."""

import contextlib
from collections.abc import Iterator

from pagedserve.kernels.kernel_set import KernelSet, block_major_kv_cache

ATTENTION = ("basic", "flash")


def kernel_set(attention: str = "flash") -> KernelSet:
    """The Triton set, on block-major caches (its block copy moves each block as one run),
    with the ``attention`` kernels of ATTENTION."""
    # Imported on use: triton is optional, and it reads TRITON_INTERPRET when a kernel
    # module is imported.
    from pagedserve.kernels.triton import cache_ops

    if attention == "flash":
        from pagedserve.kernels.triton import decode, elementwise, prefill

        return KernelSet(
            cache_ops.store_kvcache, prefill.paged_prefill_attention,
            decode.paged_decode_attention, cache_ops.copy_blocks,
            rms_norm=elementwise.rms_norm, rotary_=elementwise.rotary_,
            silu_and_mul=elementwise.silu_and_mul,
            allocate_kv_cache=block_major_kv_cache, name="triton-flash")
    if attention == "basic":
        from pagedserve.kernels.triton import basic

        return KernelSet(
            cache_ops.store_kvcache, basic.paged_prefill_attention,
            basic.paged_decode_attention, cache_ops.copy_blocks,
            allocate_kv_cache=block_major_kv_cache, name="triton-basic")
    raise ValueError(f"unknown Triton attention {attention!r}; choose one of {ATTENTION}")


@contextlib.contextmanager
def recording_builds() -> Iterator[list[str]]:
    """Yields a list that collects the name of each Triton kernel built meanwhile: a launch
    at a specialization this process had not launched before, compiled or loaded from
    Triton's disk cache (kernels/triton/common.py, VARYING_ARGS). Through Triton's
    post-compile hook, so the interpreter, which builds nothing, records nothing."""
    import triton

    runtime = triton.knobs.runtime
    names: list[str] = []
    previous = runtime.jit_post_compile_hook

    def record(**kwargs):
        names.append(getattr(kwargs.get("fn"), "name", "?"))  # a JitFunctionInfo
        return previous(**kwargs) if previous else None

    runtime.jit_post_compile_hook = record
    try:
        yield names
    finally:
        runtime.jit_post_compile_hook = previous
