"""Triton prefill attention (both versions) against its PyTorch reference: chunks with and
without a cached prefix, tiles of every size, the flat grid a whole CUDA graph launches, and
the store-prefill-decode order of a real step (setup: triton_utils.py)."""

import pytest
import torch
from triton_utils import BOTH, DECODE, DEVICE, GQA, NO_DEVICE, PREFILL, TOL, paged_setup, queries

from pagedserve.kernels import reference
from pagedserve.kernels.triton import cache_ops as tk
from pagedserve.kernels.triton import prefill as tp
from pagedserve.kernels.triton.common import pow2

if DEVICE is None:  # pragma: no cover - only when someone unsets the interpreter on a CPU host
    pytest.skip(NO_DEVICE, allow_module_level=True)


# ---------------------------------------------------------------------------------------
# paged_prefill_attention
# ---------------------------------------------------------------------------------------


def _check_prefill(
    seqs: list[tuple[int, int]],  # (context_len, query_len) per sequence
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    impl: str = "flash",
    host_max_query_len: bool = False,
    **tiles: int,
) -> None:
    """host_max_query_len: also launch as the engine's eager steps do, with the longest
    query length from the host (AttentionMetadata), on the grid sized by it rather than the
    flat one, and expect the very same output."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [c for c, _ in seqs]
    query_lens = [n for _, n in seqs]
    k_cache, v_cache, table = paged_setup(
        context_lens, block_size, num_kv_heads, head_dim, dtype, gen
    )
    q = queries(sum(query_lens), num_heads, num_kv_heads, head_dim, dtype, gen)
    cu = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu = cu.to(DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    want = reference.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale)
    got = PREFILL[impl](q, k_cache, v_cache, table, cu, lens, scale, **tiles)
    assert got.dtype == dtype and got.shape == q.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL[dtype])
    if host_max_query_len:  # flash: the host-sized grid, packed as the flat one was
        if impl == "flash" and tiles.get("pack_group") is None:
            tile_m = tiles.get("block_m") or tp.prefill_config(head_dim, dtype)[0]
            tiles = {**tiles, "pack_group": pow2(num_heads // num_kv_heads) <= tile_m}
        hinted = PREFILL[impl](q, k_cache, v_cache, table, cu, lens, scale,
                               max_query_len=max(query_lens), **tiles)
        assert torch.equal(hinted, got)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA[:2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@BOTH
def test_paged_prefill_attention_mixed(block_size: int, num_heads: int, num_kv_heads: int, dtype,
                                      impl: str):
    bs = block_size
    seqs = [
        (1, 1),  # first token of a new sequence
        (bs - 1, bs - 1),  # no cached prefix, not block aligned
        (bs, 3),  # prefix bs - 3, queries end exactly at a block boundary
        (bs + 1, 1),  # one new token after a full cached block
        (2 * bs + 7, bs + 2),  # queries span a block boundary, more than one query tile
        (300, 21),  # long cached prefix
    ]
    head_dim = 32 if dtype == torch.float32 else 16
    _check_prefill(seqs, bs, num_heads, num_kv_heads, head_dim, dtype, seed=3, impl=impl,
                   host_max_query_len=True)
    if impl == "flash" and block_size == 16:
        _check_prefill(seqs, bs, num_heads, num_kv_heads, head_dim, dtype, seed=3,
                       host_max_query_len=True, pack_group=True)


@pytest.mark.parametrize("impl", ["reference", "basic", "flash"])
def test_attention_writes_into_out(impl: str) -> None:
    """out=: a step's decode rows and its prefill rows each written into their slice of one
    buffer (models/llama.py's Attention.attend), equal to the out-of-place results, with
    the buffer's other rows left alone."""
    decode = {"reference": reference.paged_decode_attention, **DECODE}[impl]
    prefill = {"reference": reference.paged_prefill_attention, **PREFILL}[impl]
    gen, bs, dtype = torch.Generator().manual_seed(5), 16, torch.float32
    context_lens, query_lens = [40, 7, 300], [1, 1, 5]  # two decodes, then a prefill chunk
    k_cache, v_cache, table = paged_setup(context_lens, bs, 2, 32, dtype, gen)
    q = queries(sum(query_lens), 4, 2, 32, dtype, gen)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    args = (k_cache, v_cache, table[:2], lens[:2], 0.1)
    prefill_args = (k_cache, v_cache, table[2:], cu, lens[2:], 0.1)
    out = torch.full((9, 4, 32), float("nan"), dtype=dtype, device=DEVICE)  # rows 7, 8 spare
    got_decode = decode(q[:2], *args, out=out[:2])
    got_prefill = prefill(q[2:], *prefill_args, out=out[2:7])
    assert got_decode.data_ptr() == out.data_ptr() and torch.equal(got_decode, out[:2])
    assert torch.equal(got_prefill, out[2:7])
    assert torch.equal(out[:2], decode(q[:2], *args))
    assert torch.equal(out[2:7], prefill(q[2:], *prefill_args))
    assert out[7:].isnan().all()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(2, 2, 64), (4, 2, 128), (14, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pack_group", [False, True])
def test_paged_prefill_attention_small_tiles(num_heads: int, num_kv_heads: int, head_dim: int,
                                             dtype, pack_group: bool) -> None:
    """16-query x 32-key tiles (packed: 16 rows of (token, head) pairs, a group of 7 heads
    padded to 8, so 2 tokens a tile), so small shapes cross many tiles: mask-free tiles
    below the diagonal, tiles crossing it, cached prefixes longer than the queries, a query
    tile starting mid key tile, sequences of different lengths in one batch."""
    seqs = [(1, 1), (17, 17), (40, 9), (150, 35)]  # prefixes 0, 0, 31 and 115 tokens
    _check_prefill(seqs, 16, num_heads, num_kv_heads, head_dim, dtype, seed=9, block_m=16,
                   block_n=32, pack_group=pack_group)


def test_packed_prefill_refuses_a_group_larger_than_its_tile() -> None:
    with pytest.raises(ValueError, match="cannot hold a group of 14"):
        _check_prefill([(4, 4)], 16, 14, 1, 16, torch.float32, seed=1, block_m=8,
                       pack_group=True)


@pytest.mark.parametrize(("block_size", "dtype"), [(16, torch.float32), (32, torch.float16)])
@BOTH
def test_paged_prefill_attention_long_no_prefix(block_size: int, dtype, impl: str) -> None:
    # A 300-token prompt with nothing cached: many query tiles, full causal triangle.
    _check_prefill([(300, 300), (block_size + 1, 2)], block_size, 4, 2, 16, dtype, seed=4,
                   impl=impl)


def test_paged_prefill_attention_bf16_odd_shapes() -> None:
    _check_prefill([(9, 9), (40, 23)], 16, 6, 2, 24, torch.bfloat16, seed=5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (14, 2), (3, 3)])
@pytest.mark.parametrize("block_m", [None, 16])
def test_flat_grid_as_a_whole_graph_launches_it(num_heads: int, num_kv_heads: int,
                                                block_m: int | None) -> None:
    """The flash kernel without max_query_len, as a whole graph launches it
    (engine/piecewise_graphs.py): decodes and prefill chunks as one list of sequences,
    padded with empty ones (cu_seqlens_q repeating the real total, context 0), and query
    rows past the last sequence's, which belong to none. The real rows equal the
    reference's; the padding rows are left as they were. With 16-row tiles (a group of 7
    packed: 2 tokens a tile) a sequence spans many of the flat grid's programs."""
    gen = torch.Generator().manual_seed(12)
    bs, head_dim, dtype = 16, 32, torch.float32
    seqs = [(40, 1), (7, 1), (300, 1), (33, 33), (70, 21), (5, 3)]  # 3 decodes, 3 chunks
    context_lens, query_lens = [c for c, _ in seqs], [n for _, n in seqs]
    k_cache, v_cache, table = paged_setup(context_lens, bs, num_kv_heads, head_dim, dtype, gen)
    real, pad_seqs, pad_rows = sum(query_lens), 5, 11
    q = queries(real + pad_rows, num_heads, num_kv_heads, head_dim, dtype, gen)
    cu = torch.tensor([0] + query_lens + [0] * pad_seqs).cumsum(0).to(DEVICE, torch.int32)
    lens = torch.tensor(context_lens + [0] * pad_seqs, dtype=torch.int32, device=DEVICE)
    tables = torch.cat([table, torch.zeros_like(table[:1]).expand(pad_seqs, -1)])
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    tp.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, out=out,
                               block_m=block_m)
    want = reference.paged_prefill_attention(q[:real], k_cache, v_cache, table,
                                              cu[: len(seqs) + 1], lens[: len(seqs)], scale)
    torch.testing.assert_close(out[:real], want, **TOL[dtype])
    assert out[real:].isnan().all()


@BOTH
def test_store_then_prefill_then_decode(impl: str) -> None:
    # The real order of operations: new tokens' K/V go into the cache through store_kvcache,
    # then attention reads every key through the block table; then one decode step.
    gen = torch.Generator().manual_seed(6)
    block_size, num_heads, num_kv_heads, head_dim, dtype = 16, 4, 2, 16, torch.float16
    seqs = [(20, 20), (37, 5)]  # second sequence has 32 cached tokens
    context_lens = [c for c, _ in seqs]
    k_cache, v_cache, table = paged_setup(
        context_lens, block_size, num_kv_heads, head_dim, dtype, gen
    )
    # Wipe the new tokens' slots, then store them with the Triton kernel.
    slots = []
    for i, (ctx, n) in enumerate(seqs):
        for pos in range(ctx - n, ctx):
            slots.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = float("nan")
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = float("nan")
    new_k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    new_v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    tk.store_kvcache(new_k, new_v, k_cache, v_cache, slot_mapping)

    q = queries(len(slots), num_heads, num_kv_heads, head_dim, dtype, gen)
    cu = torch.tensor([0, seqs[0][1], len(slots)], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, 0.25)
    got = PREFILL[impl](q, k_cache, v_cache, table, cu, lens, 0.25)
    torch.testing.assert_close(got, want, **TOL[dtype])

    # Decode the last token of each sequence over the same cache.
    q_dec = queries(len(seqs), num_heads, num_kv_heads, head_dim, dtype, gen)
    want = reference.paged_decode_attention(q_dec, k_cache, v_cache, table, lens, 0.25)
    got = DECODE[impl](q_dec, k_cache, v_cache, table, lens, 0.25)
    torch.testing.assert_close(got, want, **TOL[dtype])


