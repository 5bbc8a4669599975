"""Every Triton kernel against its PyTorch reference.

Runs on CPU under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before this
module imports the kernels). With ``TRITON_INTERPRET=0`` and a GPU it runs on CUDA instead.
The interpreter costs ~0.1 ms per Triton op, so shapes stay small.

Caches are filled with NaN everywhere a sequence does not own a token, and block tables use
shuffled, non-contiguous physical block ids, so a missing mask or a wrong block lookup shows
up as NaN or as a mismatch.
"""

import math
import os

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.triton import basic
from pagedserve.kernels.triton import cache_ops as tk
from pagedserve.kernels.triton import decode as td
from pagedserve.kernels.triton import prefill as tp
from pagedserve.kernels.triton.common import pow2

# Both attention versions (pagedserve.kernels.triton.ATTENTION), for the tests they share.
DECODE = {"basic": basic.paged_decode_attention, "flash": td.paged_decode_attention}
PREFILL = {"basic": basic.paged_prefill_attention, "flash": tp.paged_prefill_attention}
BOTH = pytest.mark.parametrize("impl", ["basic", "flash"])

if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:  # pragma: no cover - only when someone unsets the interpreter on a CPU-only host
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a GPU", allow_module_level=True)

TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def _nan_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype):
    return torch.full(
        (num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE
    )


def _paged_setup(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN caches holding random K/V for each sequence's first context_len tokens.

    Physical blocks are handed out from a shuffled pool with spare blocks mixed in, and the
    unused tail of each block-table row points at a spare (all-NaN) block.
    """
    need = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(need) + 5  # spares stay all NaN
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare = perm.pop()
    max_blocks = max(need) + 1
    table = torch.full((len(context_lens), max_blocks), spare, dtype=torch.int32)
    k_cache = _nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    v_cache = _nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    for i, n in enumerate(context_lens):
        for j in range(need[i]):
            block = perm.pop()
            table[i, j] = block
            used = min(block_size, n - j * block_size)
            shape = (used, num_kv_heads, head_dim)
            k_cache[block, :used] = torch.randn(shape, generator=gen).to(DEVICE, dtype)
            v_cache[block, :used] = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return k_cache, v_cache, table.to(DEVICE)


def _queries(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, gen):
    """q as a strided slice of a fused qkv tensor, as a model produces it."""
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv.to(DEVICE, dtype)[:, :num_heads]


# ---------------------------------------------------------------------------------------
# store_kvcache
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_store_kvcache(block_size: int, src_dtype, cache_dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 2, 24, 11  # head_dim not a power of 2
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE, src_dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE, src_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    skipped = [0, 4, num_tokens - 1]
    slots[skipped] = -1
    slots = slots.to(DEVICE)

    caches = []
    for store in (reference.store_kvcache, tk.store_kvcache):
        k_cache = _nan_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
        v_cache = _nan_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
        store(key, value, k_cache, v_cache, slots)
        caches.append((k_cache, v_cache))

    (ref_k, ref_v), (got_k, got_v) = caches
    torch.testing.assert_close(got_k, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_v, ref_v, rtol=0, atol=0, equal_nan=True)
    # Exactly the non-skipped tokens were written; every other slot keeps its NaN poison.
    written = num_tokens - len(skipped)
    valid = slots >= 0
    for cache, src in ((got_k, key), (got_v, value)):
        flat = cache.view(-1, num_kv_heads, head_dim)
        assert int((~flat.isnan().all(dim=(1, 2))).sum()) == written
        torch.testing.assert_close(flat[slots[valid]], src[valid].to(cache_dtype), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# paged_decode_attention
# ---------------------------------------------------------------------------------------

GQA = [(4, 2), (2, 2), (14, 2)]  # (num_heads, num_kv_heads): groups 2, 1 and 7 (Qwen2.5)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@BOTH
def test_paged_decode_attention(block_size: int, num_heads: int, num_kv_heads: int, dtype,
                                impl: str):
    gen = torch.Generator().manual_seed(1)
    head_dim = 32 if dtype == torch.float32 else 16
    context_lens = [1, block_size - 1, block_size, block_size + 1, 300]
    k_cache, v_cache, table = _paged_setup(
        context_lens, block_size, num_kv_heads, head_dim, dtype, gen
    )
    q = _queries(len(context_lens), num_heads, num_kv_heads, head_dim, dtype, gen)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    want = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    got = DECODE[impl](q, k_cache, v_cache, table, lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_split_kv(head_dim: int, num_heads: int, num_kv_heads: int, dtype):
    """Split-KV on (forced partition counts) and off give the reference's result: partitions
    that end mid-tile and mid-block, empty partitions (the 1-token context), key tiles of
    several blocks; and the default heuristic's choice."""
    gen = torch.Generator().manual_seed(8)
    context_lens = [1, 37, 200]  # 37, 200: not multiples of the 16-token block or the tile
    k_cache, v_cache, table = _paged_setup(context_lens, 16, num_kv_heads, head_dim, dtype, gen)
    q = _queries(len(context_lens), num_heads, num_kv_heads, head_dim, dtype, gen)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    want = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    whole = td.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, splits=1,
                                      block_n=32)
    torch.testing.assert_close(whole, want, **TOL[dtype])
    for splits in (3, 5):  # partitions of 96 and 64 tokens (tile multiples of 32)
        got = td.paged_decode_attention(q, k_cache, v_cache, table, lens, scale,
                                        splits=splits, block_n=32)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, **TOL[dtype])
        torch.testing.assert_close(got, whole, **TOL[dtype])
    got = td.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("splits", [None, 7])
def test_paged_decode_split_kv_in_a_wide_table(splits: int | None) -> None:
    """A decode graph's block tables are as wide as the longest context the engine admits,
    far past the step's contexts: the heuristic splits by that width, and each sequence's
    partitions are cut from its own context (the kernel's), the NaN tail of its row and
    the partitions past its context never read."""
    gen = torch.Generator().manual_seed(9)
    context_lens = [1, 37, 300, 129]
    k_cache, v_cache, table = _paged_setup(context_lens, 16, 2, 64, torch.float32, gen)
    spare = int(table[0, -1])  # an all-NaN block
    wide = torch.full((len(context_lens), 16 * table.shape[1]), spare, dtype=torch.int32,
                      device=DEVICE)
    wide[:, : table.shape[1]] = table
    q = _queries(len(context_lens), 14, 2, 64, torch.float32, gen)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    want = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    if splits is None:  # 8 (sequence, KV head) programs: split by the table's width
        assert td.num_splits(len(context_lens), 2, wide.shape[1] * 16, q.device) > 1
    got = td.paged_decode_attention(q, k_cache, v_cache, wide, lens, 0.125, splits=splits,
                                    block_n=32)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_decode_split_heuristic() -> None:
    cpu = torch.device("cpu")  # counts as an H100/H200: 132 SMs
    assert td.num_splits(256, 8, 2048, cpu) == 1  # 2,048 programs fill the GPU already
    assert td.num_splits(64, 8, 8192, cpu) == 1  # 512 programs: ran as fast unsplit
    assert td.num_splits(256, 2, 1024, cpu) == 1  # Qwen2.5-0.5B, 2 KV heads: faster unsplit
    assert td.num_splits(16, 8, 8192, cpu) == 3  # 128 programs, 264 wanted
    assert td.num_splits(1, 8, 32768, cpu) == 33  # one long sequence: 264 programs
    assert td.num_splits(1, 1, 1 << 20, cpu) == 64  # the cap
    assert td.num_splits(2, 2, 300, cpu) == 1  # partitions never under 256 tokens


@BOTH
def test_paged_decode_attention_bf16_and_odd_head_dim(impl: str) -> None:
    # bf16 checks the upcast-after-load (the interpreter gets bf16 arithmetic wrong);
    # head_dim 24 and group 3 check padding of non-power-of-two extents.
    gen = torch.Generator().manual_seed(2)
    block_size, num_heads, num_kv_heads, head_dim = 16, 6, 2, 24
    context_lens = [5, 40, 17]
    k_cache, v_cache, table = _paged_setup(
        context_lens, block_size, num_kv_heads, head_dim, torch.bfloat16, gen
    )
    q = _queries(len(context_lens), num_heads, num_kv_heads, head_dim, torch.bfloat16, gen)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    want = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.2)
    got = DECODE[impl](q, k_cache, v_cache, table, lens, 0.2)
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


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
    k_cache, v_cache, table = _paged_setup(
        context_lens, block_size, num_kv_heads, head_dim, dtype, gen
    )
    q = _queries(sum(query_lens), num_heads, num_kv_heads, head_dim, dtype, gen)
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
    k_cache, v_cache, table = _paged_setup(context_lens, bs, 2, 32, dtype, gen)
    q = _queries(sum(query_lens), 4, 2, 32, dtype, gen)
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
    k_cache, v_cache, table = _paged_setup(context_lens, bs, num_kv_heads, head_dim, dtype, gen)
    real, pad_seqs, pad_rows = sum(query_lens), 5, 11
    q = _queries(real + pad_rows, num_heads, num_kv_heads, head_dim, dtype, gen)
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
    k_cache, v_cache, table = _paged_setup(
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

    q = _queries(len(slots), num_heads, num_kv_heads, head_dim, dtype, gen)
    cu = torch.tensor([0, seqs[0][1], len(slots)], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, 0.25)
    got = PREFILL[impl](q, k_cache, v_cache, table, cu, lens, 0.25)
    torch.testing.assert_close(got, want, **TOL[dtype])

    # Decode the last token of each sequence over the same cache.
    q_dec = _queries(len(seqs), num_heads, num_kv_heads, head_dim, dtype, gen)
    want = reference.paged_decode_attention(q_dec, k_cache, v_cache, table, lens, 0.25)
    got = DECODE[impl](q_dec, k_cache, v_cache, table, lens, 0.25)
    torch.testing.assert_close(got, want, **TOL[dtype])


# ---------------------------------------------------------------------------------------
# copy_blocks
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_copy_blocks(dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    num_layers, num_blocks, block_size, num_kv_heads, head_dim = 3, 12, 16, 2, 24
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    k_caches = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v_caches = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    k_caches[:, 1, 3:] = float("nan")  # a partly filled source block: NaN must copy as-is
    src = torch.tensor([1, 4, 7, 0], dtype=torch.int64, device=DEVICE)
    dst = torch.tensor([9, 2, 11, 5], dtype=torch.int64, device=DEVICE)

    want_k, want_v = k_caches.clone(), v_caches.clone()
    reference.copy_blocks(want_k, want_v, src, dst)
    tk.copy_blocks(k_caches, v_caches, src, dst)
    torch.testing.assert_close(k_caches, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_caches, want_v, rtol=0, atol=0, equal_nan=True)


def test_copy_blocks_empty_is_noop() -> None:
    k_caches = torch.zeros(2, 4, 16, 1, 16, device=DEVICE)
    v_caches = torch.zeros(2, 4, 16, 1, 16, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    tk.copy_blocks(k_caches, v_caches, empty, empty)
    assert not k_caches.any() and not v_caches.any()


# ---------------------------------------------------------------------------------------
# The Triton set inside the engine
# ---------------------------------------------------------------------------------------


@BOTH
def test_engine_with_triton_kernels_matches_reference_kernels(tmp_path, impl: str) -> None:
    """The whole Triton set driving the engine (here through the interpreter): the cache
    layout the model runner gives it, prefill chunks mixed with decodes, and a fork whose
    shared tail block is copied once per extra sample (copy_blocks)."""
    from engine_utils import make_engine, prompts_of_lengths, run, save_random_hf
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.engine import SamplingParams
    from pagedserve.kernels import REFERENCE, kernels_for
    from pagedserve.models.loader import load_model_files

    save_random_hf(tmp_path, LlamaForCausalLM, LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    loaded = load_model_files(str(tmp_path), torch.float32)
    prompts = prompts_of_lengths([37, 5], seed=6, max_id=400)
    params = [SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    results = {}
    triton_set = kernels_for(torch.device("cuda"), torch.float32, triton_attention=impl)
    for name, kernels in (("triton", triton_set),
                          ("reference", REFERENCE)):
        # Eager on a GPU too: the reference set reads tensors back on the host, which a
        # CUDA graph capture forbids (graphs are test_gpu_engine.py's subject).
        engine = make_engine(loaded, kernels, device=DEVICE.type, max_num_batched_tokens=24,
                             enforce_eager=True)
        outs = run(engine, prompts, params)
        results[name] = [[s.token_ids for s in out.outputs] for out in outs]
        # 3 prompt blocks + 2 copies of the shared tail block, and 1 block for the other.
        assert engine.stats()["peak_kv_blocks_used"] == 6, name
    assert results["triton"] == results["reference"]
    assert len({tuple(t) for t in results["triton"][0]}) > 1  # the samples do differ
