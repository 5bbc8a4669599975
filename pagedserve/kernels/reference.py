"""PyTorch reference kernels: the semantics every Triton kernel must match, and the CPU path.

A layer's cache has the logical shape ``[num_blocks, block_size, num_kv_heads, head_dim]``;
any strides are accepted. The engine stores it head-major (``[H_kv, N, block_size, d]`` in
memory), so that gathering one head's blocks yields contiguous ``[tokens, d]`` rows that a
batched matmul reads without a further copy. A slot is ``block_id * block_size + offset``.
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
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def gather_heads(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The given blocks, head-major: [H_kv, len(block_ids) * block_size, d]."""
    by_head = cache.permute(2, 0, 1, 3)  # [H_kv, N, block_size, d]; a view, no copy
    block_ids = block_ids.long()
    num_heads, _, block_size, head_dim = by_head.shape
    out = by_head.new_empty(num_heads, len(block_ids), block_size, head_dim)
    for h in range(num_heads):  # dim-0 selects of whole blocks: memcpy speed, unlike dim 1
        torch.index_select(by_head[h], 0, block_ids, out=out[h])
    return out.flatten(1, 2)


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
    table = block_tables[:, :max_blocks].reshape(-1)
    padded = max_blocks * block_size
    # [H_kv, B, padded, d]: every sequence's keys, padded to the longest.
    keys = gather_heads(k_cache, table).view(num_kv_heads, num_seqs, padded, head_dim)
    values = gather_heads(v_cache, table).view(num_kv_heads, num_seqs, padded, head_dim)
    # GQA without repeating K/V: the query heads sharing a KV head form one matmul.
    group = num_heads // num_kv_heads
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).to(keys.dtype)
    scores = torch.matmul(qg, keys.transpose(2, 3)).float() * scale  # [H_kv, B, g, padded]
    pad = torch.arange(padded, device=q.device)[None, :] >= context_lens[:, None]  # [B, padded]
    # where(), not a multiply: padded slots may hold anything, NaN included.
    scores = scores.masked_fill(pad[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [H_kv, B, g, d]
    if not bool(torch.isfinite(out).all()):  # 0 * NaN is NaN: clear the unread slots
        out = torch.matmul(probs, values.masked_fill(pad[None, :, :, None], 0.0))
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim).to(q.dtype)


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
    blocks = block_table[: (context_len + k_cache.shape[1] - 1) // k_cache.shape[1]]
    keys = gather_heads(k_cache, blocks)[:, :context_len]  # [H_kv, context_len, d]
    values = gather_heads(v_cache, blocks)[:, :context_len]
    if n == context_len:  # no cached prefix: plain causal attention
        mask, causal = None, True
    else:  # causal over absolute positions: query j sits at context_len - n + j
        q_pos = torch.arange(context_len - n, context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
        causal = False
    # 4-D inputs with the KV heads repeated take PyTorch's fused (flash) CPU kernel; 3-D or
    # enable_gqa inputs fall back to the unfused math path, ~20x slower at these shapes.
    group = q.shape[1] // keys.shape[0]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.to(q.dtype).repeat_interleave(group, 0)[None],
        values.to(q.dtype).repeat_interleave(group, 0)[None],
        attn_mask=mask, is_causal=causal, scale=scale)
    return out[0].transpose(0, 1)


def copy_blocks(
    k_caches: torch.Tensor,  # [L, N, block_size, H_kv, d]
    v_caches: torch.Tensor,
    src: torch.Tensor,  # [n] int64
    dst: torch.Tensor,  # [n] int64
) -> None:
    k_caches[:, dst] = k_caches[:, src]
    v_caches[:, dst] = v_caches[:, src]
