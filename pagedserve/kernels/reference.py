"""PyTorch reference kernels: the semantics every Triton kernel must match, and the CPU path.

Cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A slot is ``block_id * block_size + offset``.
"""

import torch
import torch.nn.functional as F


def store_kvcache(
    key: torch.Tensor,  # [T, H_kv, d]
    value: torch.Tensor,  # [T, H_kv, d]
    k_cache: torch.Tensor,  # [N, block_size, H_kv, d]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 writes nothing
) -> None:
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence's K or V: [length, H_kv, d]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:length]


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, d], one query per sequence at position context_len - 1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :max_blocks].reshape(-1).long()

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [B, H_kv, max_len, d], padded
        blocks = cache.index_select(0, table).view(num_seqs, max_blocks * block_size, -1)
        return blocks[:, :max_len].view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)

    keys, values = gather(k_cache), gather(v_cache)
    pad = torch.arange(max_len, device=q.device)[None, :] >= context_lens[:, None]  # [B, L]
    # GQA without repeating K/V: the group of query heads sharing a KV head is one matmul.
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).to(keys.dtype)
    scores = torch.matmul(qg, keys.transpose(2, 3)).float() * scale  # [B, H_kv, g, L]
    # where(), not a multiply: padded slots may hold anything, NaN included.
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    values = values.masked_fill(pad[:, None, :, None], 0.0)
    out = torch.matmul(probs, values)  # [B, H_kv, g, d]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, d], the new tokens of every sequence, concatenated
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    context_lens: torch.Tensor,  # [S] int32, cached prefix + new tokens
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        out[lo:hi] = prefill_one(q[lo:hi], k_cache, v_cache, block_tables[i], context_len, scale)
    return out


def prefill_one(
    q: torch.Tensor,  # [n, H, d]: positions context_len - n .. context_len - 1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    n = q.shape[0]
    keys = gather_kv(k_cache, block_table, context_len)
    values = gather_kv(v_cache, block_table, context_len)
    q_pos = torch.arange(context_len - n, context_len, device=q.device)
    k_pos = torch.arange(context_len, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]  # causal over absolute positions
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.to(q.dtype).transpose(0, 1),
        values.to(q.dtype).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def copy_blocks(
    k_caches: torch.Tensor,  # [L, N, block_size, H_kv, d]
    v_caches: torch.Tensor,
    src: torch.Tensor,  # [n] int64
    dst: torch.Tensor,  # [n] int64
) -> None:
    k_caches[:, dst] = k_caches[:, src]
    v_caches[:, dst] = v_caches[:, src]
