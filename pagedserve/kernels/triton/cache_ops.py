"""Triton kernels for the cache itself: the K/V store and the block copy (paged attention
is in ``attention``). Conventions in ``common``.

Cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``, block-major
(each block one contiguous run, as copy_blocks needs); a slot is
``block_id * block_size + offset``.
"""

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton.common import VARYING_POINTERS, pow2

# --------------------------------------------------------------------------------------
# store_kvcache
# --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize_on_alignment=VARYING_POINTERS)
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: scatter its [H_kv, d] key and value into one cache slot.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # slot -1 writes nothing: folded into the mask (no early return, no clamped address use).
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim) & (slot >= 0)
    safe_slot = tl.where(slot >= 0, slot, 0)
    block = safe_slot // block_size
    offset = safe_slot % block_size

    k = tl.load(
        key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
        other=0.0,
    )
    kc = (
        k_cache_ptr
        + block * stride_kcb
        + offset * stride_kcs
        + offs_h[:, None] * stride_kch
        + offs_d[None, :] * stride_kcd
    )
    vc = (
        v_cache_ptr
        + block * stride_vcb
        + offset * stride_vcs
        + offs_h[:, None] * stride_vch
        + offs_d[None, :] * stride_vcd
    )
    # A pure copy (plus the cast to the cache dtype): no arithmetic, so no upcast needed.
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,  # [T, H_kv, d]
    value: torch.Tensor,  # [T, H_kv, d]
    k_cache: torch.Tensor,  # [N, block_size, H_kv, d]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 writes nothing
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_size,
        num_kv_heads,
        head_dim,
        BLOCK_H=pow2(num_kv_heads),
        BLOCK_D=pow2(head_dim),
    )


# --------------------------------------------------------------------------------------
# copy_blocks
# --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize_on_alignment=VARYING_POINTERS)
def _copy_blocks_kernel(
    k_caches_ptr,
    v_caches_ptr,
    src_ptr,
    dst_ptr,
    stride_kl,
    stride_kb,
    stride_vl,
    stride_vb,
    block_numel,
    BLOCK: tl.constexpr,
):
    # One program per (pair, layer); a block is contiguous, so copy it as a flat run.
    pair = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    k_src = k_caches_ptr + layer * stride_kl + src * stride_kb
    k_dst = k_caches_ptr + layer * stride_kl + dst * stride_kb
    v_src = v_caches_ptr + layer * stride_vl + src * stride_vb
    v_dst = v_caches_ptr + layer * stride_vl + dst * stride_vb
    for start in range(0, block_numel, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < block_numel
        # A raw copy, no arithmetic: values (NaN included) move bit for bit.
        tl.store(k_dst + offs, tl.load(k_src + offs, mask=mask), mask=mask)
        tl.store(v_dst + offs, tl.load(v_src + offs, mask=mask), mask=mask)


def copy_blocks(
    k_caches: torch.Tensor,  # [L, N, block_size, H_kv, d]
    v_caches: torch.Tensor,
    src: torch.Tensor,  # [n] int64
    dst: torch.Tensor,  # [n] int64
) -> None:
    num_pairs = src.shape[0]
    if num_pairs == 0:
        return
    num_layers = k_caches.shape[0]
    block_numel = k_caches[0, 0].numel()
    # The kernel copies each block as one flat run, which needs the inner dims contiguous.
    for cache in (k_caches, v_caches):
        if not cache[0, 0].is_contiguous():
            raise ValueError("copy_blocks needs each cache block to be contiguous")
    _copy_blocks_kernel[(num_pairs, num_layers)](
        k_caches,
        v_caches,
        src,
        dst,
        k_caches.stride(0),
        k_caches.stride(1),
        v_caches.stride(0),
        v_caches.stride(1),
        block_numel,
        BLOCK=min(pow2(block_numel), 4096),
    )
