"""The first Triton paged attention ("basic"): decode one 16-token block at a time, prefill
without tensor cores; same signatures and semantics as ``reference``. It is the one that
passed on an H200, so it stays the default until ``decode``/``prefill`` ("flash") have
passed there too (scripts/gpu-check.sh); then this file goes."""

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton.common import VARYING_ARGS, longest_query, pow2

# A finite "minus infinity" for the running max: exp(m_old - m_new) stays 0, never NaN,
# even while every score seen so far is masked.
# constexpr: a compiled (non-interpreted) kernel may only read constexpr globals.
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


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
# paged_decode_attention
# --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=VARYING_ARGS)
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    stride_qb,
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
    stride_btb,
    stride_btn,
    stride_ob,
    stride_oh,
    stride_od,
    block_size,
    group,
    head_dim,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (sequence, kv head): the kv head's whole group of query heads is
    # handled together, so each K/V block is read once per group rather than per head.
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kvh * group + offs_g  # query heads h with h // group == kvh

    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * scale  # fold the softmax scale into q once

    m_i = tl.full([BLOCK_G], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    num_blocks = (context_len + block_size - 1) // block_size
    for b in range(0, num_blocks):
        block_id = tl.load(block_tables_ptr + seq * stride_btb + b * stride_btn).to(tl.int64)
        pos = b * block_size + offs_n
        n_mask = (offs_n < block_size) & (pos < context_len)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _load_block(k_cache_ptr, block_id, offs_n, kvh, offs_d, kv_mask,
                        stride_kcb, stride_kcs, stride_kch, stride_kcd)
        v = _load_block(v_cache_ptr, block_id, offs_n, kvh, offs_d, kv_mask,
                        stride_vcb, stride_vcs, stride_vch, stride_vcd)

        # [G, N] scores by broadcast-and-sum: the group is often < 16 rows, below tl.dot's
        # minimum on a GPU, and decode is memory bound anyway.
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = tl.where(n_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        p = tl.where(n_mask[None, :], p, 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    # context_len 0 would leave l_i = 0: write zeros rather than 0/0.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, d], one query per sequence at position context_len - 1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, d] to write into; None: a new tensor
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    _decode_kernel[(num_seqs, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        float(scale),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        block_size,
        group,
        head_dim,
        BLOCK_G=pow2(group),
        BLOCK_N=pow2(block_size),
        BLOCK_D=pow2(head_dim),
    )
    return out


# --------------------------------------------------------------------------------------
# paged_prefill_attention
# --------------------------------------------------------------------------------------

# Query rows per program. 16 is tl.dot's minimum on a GPU; the other dot extents are padded
# to at least 16 too, so the same shapes are used under the interpreter and on a GPU.
_PREFILL_BLOCK_M = 16


@triton.jit(do_not_specialize=VARYING_ARGS)
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
    max_query_len: int | None = None,  # AttentionMetadata's; None: read from cu_seqlens_q
    out: torch.Tensor | None = None,  # [T, H, d] to write into; None: a new tensor
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or num_seqs == 0:
        return out
    max_query_len = max_query_len or longest_query(cu_seqlens_q)
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, _PREFILL_BLOCK_M))
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
