"""PyTorch reference kernels: the semantics every C++ and Triton kernel must match, and the
CPU path without the C++ kernels (``--no-native-kernels``).

A layer's cache has the logical shape ``[num_blocks, block_size, num_kv_heads, head_dim]``,
in any memory layout (any strides): the reference set's own cache is block-major
(contiguous, ``kernel_set.block_major_kv_cache``); the C++ set hands its head-major views,
key blocks d-major, to ``paged_prefill_attention`` and to the decode fallback; the tests
build others. A slot is ``block_id * block_size + offset``.
"""

import functools
from collections.abc import Callable

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


def gather_heads(cache: torch.Tensor, block_ids: torch.Tensor) -> list[torch.Tensor]:
    """The given blocks of each KV head: H_kv tensors of [len(block_ids) * block_size, d]."""
    by_head = cache.permute(2, 0, 1, 3)  # [H_kv, N, block_size, d]; a view, no copy
    block_ids = block_ids.long()
    # A dim-0 select of whole blocks, one head at a time. On the block-major cache the
    # reference set allocates, a head's block is block_size rows of d, not one run, so this
    # is no longer memcpy speed; a dim-1 select (all heads at once) is ~20x slower still.
    # `scripts/bench_reference_layouts.py --seqs 64 --context 400 --threads 1` (AMD EPYC,
    # 2 shared vCPUs, AVX2, no AVX-512/AMX): one decode step's K+V (19.7 MB) gathers in
    # 7.8 ms block-major, 5.6-5.7 ms head-major, a plain copy 3.6-3.8 ms; decode attention
    # 31-35 ms vs 29-33 ms, prefill within noise. Under ~3x that load (four runs): all ~2x
    # slower, gather 1.3-1.9x head-major, dim-1 select 280-340 ms block-major (about as
    # fast as this head-major), a preallocated out= no faster than this.
    return [by_head[h].index_select(0, block_ids).flatten(0, 1) for h in range(len(by_head))]


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
    max_len = int(context_lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :max_blocks].reshape(-1)
    padded = max_blocks * block_size
    pad = torch.arange(padded, device=q.device)[None, :] >= context_lens[:, None]  # [B, padded]
    group = num_heads // num_kv_heads
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).to(k_cache.dtype)
    grouped = torch.empty(num_seqs, num_kv_heads, group, head_dim, dtype=q.dtype,
                          device=q.device)
    # One KV head at a time: the query heads that share it form one batched matmul (GQA
    # without repeating K/V), over every sequence's keys padded to the longest.
    keys, values = gather_heads(k_cache, table), gather_heads(v_cache, table)
    for h in range(num_kv_heads):
        k = keys[h].view(num_seqs, padded, head_dim)
        v = values[h].view(num_seqs, padded, head_dim)
        scores = torch.bmm(qg[:, h], k.transpose(1, 2)).float() * scale  # [B, g, padded]
        # where(), not a multiply: padded slots may hold anything, NaN included.
        scores.masked_fill_(pad[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        head_out = torch.bmm(probs, v)
        if not bool(torch.isfinite(head_out).all()):  # 0 * NaN is NaN: clear unread slots
            head_out = torch.bmm(probs, v.masked_fill(pad[:, :, None], 0.0))
        grouped[:, h] = head_out
    return written_to(out, grouped.view(num_seqs, num_heads, head_dim))


def written_to(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into ``out`` when the caller gave one (an attention op's out=)."""
    return result if out is None else out.copy_(result)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, d], the new tokens of every sequence, concatenated
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    context_lens: torch.Tensor,  # [S] int32, cached prefix + new tokens
    scale: float,
    gather_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    max_query_len: int | None = None,  # unused: the loop reads the lengths itself
    out: torch.Tensor | None = None,  # [T, H, d] to write into; None: a new tensor
) -> torch.Tensor:
    """Per sequence: gather its context's K/V (``gather_kv``, by default the PyTorch one
    below; the C++ kernels pass theirs), then PyTorch's fused attention over it."""
    gather_kv = gather_kv or _gather_kv
    out = torch.empty_like(q) if out is None else out
    starts = cu_seqlens_q.tolist()
    group = q.shape[1] // k_cache.shape[2]
    for i, ctx in enumerate(context_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if lo == hi:  # no new tokens (a whole graph's padding): nothing to attend from
            continue
        keys, values = gather_kv(k_cache, v_cache, block_tables[i], ctx, group)
        fresh = hi - lo == ctx  # no cached prefix: plain causal attention
        # 4-D inputs with the KV heads repeated take PyTorch's fused (flash) CPU kernel; 3-D
        # or enable_gqa inputs fall back to the unfused math path, ~20x slower here.
        attn = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1)[None], keys[None].to(q.dtype), values[None].to(q.dtype),
            attn_mask=None if fresh else _suffix_mask(hi - lo, ctx, q.dtype, q.device),
            is_causal=fresh, scale=scale)
        out[lo:hi] = attn[0].transpose(0, 1)
    return out


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               ctx: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first ctx keys and values, [H_kv * group, ctx, d] each: every KV head
    repeated for the query heads that read it."""
    blocks = block_table[: (ctx + k_cache.shape[1] - 1) // k_cache.shape[1]]
    keys = torch.stack(gather_heads(k_cache, blocks))[:, :ctx]
    values = torch.stack(gather_heads(v_cache, blocks))[:, :ctx]
    return keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)


@functools.lru_cache(maxsize=256)
def _suffix_mask(n: int, ctx: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask over absolute positions (query j sits at ctx - n + j): the same
    for every layer of a forward, so built once per shape, and additive so that attention
    does not convert it on every call."""
    allowed = (torch.arange(ctx, device=device)[None, :]
               <= torch.arange(ctx - n, ctx, device=device)[:, None])
    return torch.zeros(n, ctx, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def copy_blocks(
    k_caches: torch.Tensor,  # [L, N, block_size, H_kv, d]
    v_caches: torch.Tensor,
    src: torch.Tensor,  # [n] int64
    dst: torch.Tensor,  # [n] int64
) -> None:
    k_caches[:, dst] = k_caches[:, src]
    v_caches[:, dst] = v_caches[:, src]


def rms_norm(
    x: torch.Tensor,  # [rows, hidden]
    residual: torch.Tensor | None,  # [rows, hidden]; if given, residual += x first (in place)
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """RMSNorm in float32, like the reference implementations, rounded back to x's dtype."""
    if residual is not None:
        x = residual.add_(x)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotary_(
    x: torch.Tensor,  # [T, heads, d], rotated in place
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_positions, d/2] float32
    sin: torch.Tensor,
) -> None:
    """Rotate-half RoPE by absolute position, computed in float32."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: x = [gate | up] -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> [rows] int64: the first maximum of each row; a NaN counts as the
    maximum. (max(dim).indices: the same rule as argmax(), ~3x faster on CPU.)"""
    return x.max(dim=-1).indices
