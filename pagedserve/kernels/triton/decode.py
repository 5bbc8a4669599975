"""Triton paged decode attention (one query per sequence), flash-decoding style.

Stage 1, one program per (sequence, KV head, partition of the context): the KV head's whole
query group is one [G, d] tile (G padded to 16 for tl.dot), so each K/V byte is read once
per group. Keys come in tiles of BLOCK_N tokens gathered through the block table, several
cache blocks per iteration. With one partition the program writes the output; with more,
each writes its partial (max, sum, unnormalized output) and stage 2 combines them.

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
    sm_count,
    softmax_step,
    token_rows,
)

# Split-KV: split while there are fewer (sequence, KV head) programs than this many per SM,
# into partitions of at least _MIN_PARTITION tokens, so the partials (4 * (d + 2) bytes per
# query head) stay small next to the K/V a partition reads. On an H200 (132 SMs), 512
# programs ran as fast or faster unsplit; 64 ran faster split (docs/performance-gpu.md).
_PROGRAMS_PER_SM = 2
_MIN_PARTITION = 256
_MAX_SPLITS = 64


def decode_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N key tile, num_warps, num_stages), the fastest of 27 in
    scripts/sweep_triton_configs.py on an H200 in bf16: 96-100% of the device-copy bandwidth
    on Llama-3-8B's heads (d=128; 4 warps/2 stages gave 76%), 64% on Qwen2.5-0.5B's (d=64,
    256 sequences x 1,024 tokens)."""
    return (64, 2, 3) if head_dim > 64 else (128, 4, 1)


@triton.jit(do_not_specialize=VARYING_ARGS)
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    qk_scale, min_part, num_parts, group,
    stride_qb, stride_qh, stride_qd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, DOT_MODE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # a constexpr: positions split into blocks by shifts
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    # The sequence's own partitions: num_parts of whole tiles, at least min_part tokens, cut
    # from its context, not from the table's width (a decode graph's table is as wide as
    # the longest context the engine admits: partitions cut from that would leave a short
    # context in the first one, the rest of the grid idle).
    part_len = tl.maximum(tl.cdiv(tl.cdiv(context_len, num_parts), BLOCK_N) * BLOCK_N,
                          min_part)
    start = split * part_len
    end = tl.minimum(start + part_len, context_len)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    heads = kvh * group + offs_g  # the query heads h with h // group == kvh
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_btb

    # Whole tiles without any token mask, then at most one partial tile.
    for t in range(start, full_end, BLOCK_N):
        pos = t + offs_n
        block, slot = token_rows(table, stride_btn, pos, pos < end, BLOCK_SIZE)
        k_rows = block * stride_kcb + slot * stride_kcs + kvh * stride_kch
        v_rows = block * stride_vcb + slot * stride_vcs + kvh * stride_vch
        k = load_kv(k_cache_ptr, k_rows, offs_d, pos < end, d_mask, stride_kcd, False, EVEN_D)
        v = load_kv(v_cache_ptr, v_rows, offs_d, pos < end, d_mask, stride_vcd, False, EVEN_D)
        m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, pos[None, :] < end, qk_scale,
                                     DOT_MODE, False)
    for t in range(full_end, end, BLOCK_N):
        pos = t + offs_n
        n_mask = pos < end
        block, slot = token_rows(table, stride_btn, pos, n_mask, BLOCK_SIZE)
        k_rows = block * stride_kcb + slot * stride_kcs + kvh * stride_kch
        v_rows = block * stride_vcb + slot * stride_vcs + kvh * stride_vch
        k = load_kv(k_cache_ptr, k_rows, offs_d, n_mask, d_mask, stride_kcd, True, EVEN_D)
        v = load_kv(v_cache_ptr, v_rows, offs_d, n_mask, d_mask, stride_vcd, True, EVEN_D)
        m_i, l_i, acc = softmax_step(q, k, v, m_i, l_i, acc, n_mask[None, :], qk_scale,
                                     DOT_MODE, True)

    store_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # context_len 0: zeros, not 0/0
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # Partials, contiguous [B, H, num_parts] (+ [HEAD_DIM]); an empty partition
        # writes (NEG_BIG, 0, 0), which stage 2 weighs as nothing.
        part = (seq * group * tl.num_programs(1) + heads) * num_parts + split
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=store_mask)


@triton.jit(do_not_specialize=VARYING_ARGS)
def _reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_parts,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # One program per (sequence, query head): rescale each partition to the global max.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_parts
    d_mask = offs_d < HEAD_DIM
    part = (seq * tl.num_programs(1) + head) * num_parts + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=NEG_BIG)
    l_part = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(w * l_part, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device
               ) -> int:
    """Partitions per (sequence, KV head): enough programs to fill the GPU a few times over,
    never partitions shorter than _MIN_PARTITION tokens."""
    programs = num_seqs * num_kv_heads
    target = _PROGRAMS_PER_SM * sm_count(device)
    if programs >= target:
        return 1
    by_fill = triton.cdiv(target, programs)
    by_length = max(1, max_context // _MIN_PARTITION)
    return max(1, min(by_fill, by_length, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, d], one query per sequence at position context_len - 1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    *,
    splits: int | None = None,  # force the partition count (tests); None: num_splits()
    block_n: int | None = None,  # force a config (tests, scripts/sweep_triton_configs.py);
    num_warps: int | None = None,  # None: decode_config()
    num_stages: int | None = None,
    out: torch.Tensor | None = None,  # [B, H, d] to write into; None: a new tensor
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    # The block tables are as wide as the longest context needs: a bound with no host sync.
    max_context = max(1, block_tables.shape[1] * block_size)
    tile, warps, stages = decode_config(head_dim)
    tile, warps, stages = block_n or tile, num_warps or warps, num_stages or stages
    n_splits = splits or num_splits(num_seqs, num_kv_heads, max_context, q.device)
    # Each sequence's partitions are whole tiles of its own context (the kernel cuts them),
    # at least _MIN_PARTITION tokens where the split is the heuristic's.
    min_part = tile if splits else triton.cdiv(_MIN_PARTITION, tile) * tile
    if n_splits > 1:
        part_m = torch.empty(num_seqs, num_heads, n_splits, dtype=torch.float32,
                             device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_seqs, num_heads, n_splits, head_dim, dtype=torch.float32,
                               device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    block_d = pow2(head_dim, 16)
    _decode_kernel[(num_seqs, num_kv_heads, n_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_m, part_l, part_acc,
        float(scale) * LOG2E, min_part, n_splits, group,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *out.stride(),
        HEAD_DIM=head_dim, BLOCK_G=pow2(group, 16), BLOCK_N=tile, BLOCK_D=block_d,
        SPLIT=n_splits > 1, DOT_MODE=dot_mode(k_cache.dtype), BLOCK_SIZE=block_size,
        num_warps=warps, num_stages=stages,
    )
    if n_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            part_m, part_l, part_acc, out, n_splits, *out.stride(),
            # One width for every split count up to _MAX_SPLITS: one build (the partials
            # past num_parts are masked off).
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=pow2(n_splits, _MAX_SPLITS),
            num_warps=4,
        )
    return out
