"""Triton paged prefill attention (chunks of new tokens, with or without a cached prefix),
flash-attention style on tensor cores.

One program per (query head, tile of BLOCK_M new tokens, sequence). With ``pack_group``,
one program per (KV head, tile, sequence) instead: its BLOCK_M rows are (token, query head)
pairs covering the KV head's whole query group, so each K/V tile it loads serves every head
of the group (vLLM's Triton attention packs heads the same way).

The grid's tile axis is sized from the longest chunk, which the engine knows on the host.
Without it (``max_query_len=None``) the grid is flat instead: the tiles of every sequence
in one axis of ``tokens // tile + sequences`` programs, each finding its sequence by a
binary search of cu_seqlens_q. That size follows the tensors' shapes alone, so a CUDA
graph captured once serves every step of that many (padded) tokens and sequences, whatever
their lengths (engine/piecewise_graphs.py's whole graphs); no host sync reads lengths.

Keys come in tiles of BLOCK_N tokens gathered through the block table, so the cached
prefix (prefix-cache hits, earlier chunks of a chunked prefill) and the new tokens (already
stored in the cache) are read the same way. Key tiles wholly below the tile's first query
need no mask; the few that cross the diagonal are masked; those wholly above it are never
visited.

Conventions in ``common``."""

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton.common import (
    LOG2E,
    NEG_BIG,
    VARYING_ARGS,
    dot_mode,
    load_kv,
    pow2,
    softmax_step,
    token_rows,
)


def prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). 16-bit: the fastest of 48 in
    scripts/sweep_triton_configs.py on an H200 (docs/performance-gpu.md): 128 x 32
    tiles at d=128, 64 x 32 at d <= 64, 4 warps and 2 stages. fp32 (the tests) runs
    64 x 32 tiles too, which fit its doubled operands."""
    if dtype == torch.float32 or head_dim <= 64:
        return 64, 32, 4, 2
    return 128, 32, 4, 2


@triton.jit(do_not_specialize=VARYING_ARGS)
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    out_ptr,
    qk_scale, group,
    stride_qt, stride_qh, stride_qd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_bts, stride_btn,
    stride_ot, stride_oh, stride_od, num_seqs,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_MODE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP_P: tl.constexpr, FLAT: tl.constexpr,
):
    # Heads vary fastest: programs running together share a KV head's tiles in L2. Tiles
    # run last-first: the last tiles of a sequence see the most keys, so they start early.
    # GROUP_P: query heads per program (1; or the group padded to a power of two, packed).
    program_head = tl.program_id(0).to(tl.int64)
    TILE_Q: tl.constexpr = BLOCK_M // GROUP_P  # new tokens per tile
    if FLAT:
        # Sequence s owns programs [start(s), start(s + 1)), start(s) = cu[s] // TILE_Q + s:
        # at least ceil(q_len / TILE_Q) of them (the extra one stores nothing), and the
        # starts strictly increase, so the last s with start(s) <= pid is pid's.
        pid = tl.num_programs(1) - 1 - tl.program_id(1)
        lo = pid * 0
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            below = tl.load(cu_seqlens_q_ptr + mid) // TILE_Q + mid <= pid
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        tile = pid - (tl.load(cu_seqlens_q_ptr + lo) // TILE_Q + lo)
        seq = lo.to(tl.int64)
    else:
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
        seq = tl.program_id(2).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_M)
    in_group = offs_r % GROUP_P  # row r: token r // GROUP_P, head r % GROUP_P of the group
    if GROUP_P == 1:  # resolved at compile time: one head, as a scalar
        kvh = program_head // group
        head = program_head
    else:
        kvh = program_head
        head = program_head * group + in_group

    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int32) - q_start
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    prefix = context_len - q_len  # the new tokens are the last q_len positions

    offs_m = tile * TILE_Q + offs_r // GROUP_P  # index among this sequence's new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = (offs_m < q_len) & (in_group < group)
    d_mask = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    q_pos = prefix + offs_m  # absolute positions, for the causal mask

    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bts

    # Keys [0, kv_end): up to the tile's last query. A tile past the end of its sequence (the
    # grid is sized for the longest) gets none and stores nothing.
    rows = tl.minimum(q_len - tile * TILE_Q, TILE_Q)
    first = prefix + tile * TILE_Q  # the tile's first query's position
    kv_end = tl.where(rows > 0, first + rows, 0)
    free_end = tl.minimum((first + 1) // BLOCK_N * BLOCK_N, kv_end)  # every row sees these

    for t in range(0, free_end, BLOCK_N):
        k_pos = t + offs_n
        block, slot = token_rows(table, stride_btn, k_pos, k_pos < kv_end, BLOCK_SIZE)
        k_rows = block * stride_kcb + slot * stride_kcs + kvh * stride_kch
        v_rows = block * stride_vcb + slot * stride_vcs + kvh * stride_vch
        k = load_kv(k_cache_ptr, k_rows, offs_d, k_pos < kv_end, d_mask, stride_kcd, False,
                    EVEN_D)
        v = load_kv(v_cache_ptr, v_rows, offs_d, k_pos < kv_end, d_mask, stride_vcd, False,
                    EVEN_D)
        m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, k_pos[None, :] < kv_end,
                                     qk_scale, DOT_MODE, False)
    for t in range(free_end, kv_end, BLOCK_N):  # the tiles crossing the diagonal
        k_pos = t + offs_n
        n_mask = k_pos < kv_end
        block, slot = token_rows(table, stride_btn, k_pos, n_mask, BLOCK_SIZE)
        k_rows = block * stride_kcb + slot * stride_kcs + kvh * stride_kch
        v_rows = block * stride_vcb + slot * stride_vcs + kvh * stride_vch
        k = load_kv(k_cache_ptr, k_rows, offs_d, n_mask, d_mask, stride_kcd, True, EVEN_D)
        v = load_kv(v_cache_ptr, v_rows, offs_d, n_mask, d_mask, stride_vcd, True, EVEN_D)
        causal = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, causal, qk_scale, DOT_MODE, True)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(
        out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :] * stride_od,
        (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
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
    *,
    max_query_len: int | None = None,  # AttentionMetadata's; None: a flat grid (see above)
    block_m: int | None = None,  # force the tiles (tests); None: prefill_config()
    block_n: int | None = None,
    num_warps: int | None = None,  # other configs: scripts/sweep_triton_configs.py
    num_stages: int | None = None,
    pack_group: bool | None = None,  # one program per KV head's query group (see above);
    # None: packed on the flat grid where the group fits a tile (a decode's one token
    # then reads its K/V once for the group), per head otherwise
    out: torch.Tensor | None = None,  # [T, H, d] to write into; None: a new tensor
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or num_seqs == 0:
        return out
    tile_m, tile_n, warps, stages = prefill_config(head_dim, k_cache.dtype)
    tile_m, tile_n = block_m or tile_m, block_n or tile_n
    num_warps, num_stages = num_warps or warps, num_stages or stages
    group = num_heads // num_kv_heads
    flat = not max_query_len  # None (or 0, which no step with prefill rows has)
    if pack_group is None:
        pack_group = flat and pow2(group) <= tile_m
    group_p = pow2(group) if pack_group else 1
    if tile_m < group_p:
        raise ValueError(f"a {tile_m}-row tile cannot hold a group of {group} query heads")
    tile_q = tile_m // group_p
    heads = num_kv_heads if pack_group else num_heads
    grid = ((heads, num_tokens // tile_q + num_seqs, 1) if flat
            else (heads, triton.cdiv(max_query_len, tile_q), num_seqs))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        float(scale) * LOG2E, group,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *out.stride(), num_seqs,
        HEAD_DIM=head_dim, BLOCK_M=tile_m, BLOCK_N=tile_n, BLOCK_D=pow2(head_dim, 16),
        DOT_MODE=dot_mode(k_cache.dtype), BLOCK_SIZE=block_size, num_warps=num_warps,
        num_stages=num_stages, GROUP_P=group_p, FLAT=flat,
    )
    return out
