"""Triton paged attention, the CUDA path: decode (one query per sequence) and prefill
(chunks, with or without a cached prefix), same signatures and semantics as ``reference``.
The conventions every Triton kernel here follows, and why, are in ``common``."""

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton.common import pow2
from pagedserve.kernels.triton.decode import paged_decode_attention

# A finite "minus infinity" for the running max: exp(m_old - m_new) stays 0, never NaN,
# even while every score seen so far is masked.
# constexpr: a compiled (non-interpreted) kernel may only read constexpr globals.
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)

__all__ = ["paged_decode_attention", "paged_prefill_attention"]


@triton.jit
def _load_block(cache_ptr, block_id, offs_n, kvh, offs_d, mask,
                stride_b, stride_s, stride_h, stride_d):
    """One KV head's slots of one cache block, [N, D] in fp32; masked entries read 0."""
    return tl.load(
        cache_ptr
        + block_id * stride_b
        + offs_n[:, None].to(tl.int64) * stride_s
        + kvh * stride_h
        + offs_d[None, :] * stride_d,
        mask=mask,
        other=0.0,
    ).to(tl.float32)


# --------------------------------------------------------------------------------------
# paged_prefill_attention
# --------------------------------------------------------------------------------------

# Query rows per program. 16 is tl.dot's minimum on a GPU; the other dot extents are padded
# to at least 16 too, so the same shapes are used under the interpreter and on a GPU.
_PREFILL_BLOCK_M = 16


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_bts,
    stride_btn,
    stride_ot,
    stride_oh,
    stride_od,
    block_size,
    group,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (sequence, query head, tile of BLOCK_M new tokens).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    kvh = head // group

    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int32)
    q_end = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int32)
    q_len = q_end - q_start
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    prefix = context_len - q_len  # the new tokens are the last q_len positions

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this sequence's new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_pos = prefix + offs_m  # absolute positions, for the causal mask

    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * scale

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys this tile can see: up to its last valid query's position. A tile past the end of
    # the sequence (the grid is sized for the longest one) gets no blocks and stores nothing.
    last = tl.minimum(tile * BLOCK_M + BLOCK_M, q_len)
    kv_end = tl.where(last > tile * BLOCK_M, prefix + last, 0)
    num_blocks = (kv_end + block_size - 1) // block_size
    for b in range(0, num_blocks):
        block_id = tl.load(block_tables_ptr + seq * stride_bts + b * stride_btn).to(tl.int64)
        k_pos = b * block_size + offs_n
        n_mask = (offs_n < block_size) & (k_pos < context_len)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _load_block(k_cache_ptr, block_id, offs_n, kvh, offs_d, kv_mask,
                        stride_kcb, stride_kcs, stride_kch, stride_kcd)
        v = _load_block(v_cache_ptr, block_id, offs_n, kvh, offs_d, kv_mask,
                        stride_vcb, stride_vcs, stride_vch, stride_vcd)

        # ieee: fp32 dot without tf32, so a GPU matches the reference as the interpreter does.
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        valid = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        p = tl.where(valid, p, 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, d], the new tokens of every sequence, concatenated
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    context_lens: torch.Tensor,  # [S] int32, cached prefix + new tokens
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # The grid needs the longest query length: one small host sync (the reference syncs too).
    max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    grid = (num_seqs, num_heads, triton.cdiv(max_q_len, _PREFILL_BLOCK_M))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        float(scale),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        block_size,
        num_heads // num_kv_heads,
        head_dim,
        BLOCK_M=_PREFILL_BLOCK_M,
        BLOCK_N=pow2(block_size, 16),
        BLOCK_D=pow2(head_dim, 16),
    )
    return out
