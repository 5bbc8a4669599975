"""Every Triton kernel but prefill attention against its PyTorch reference: the K/V store,
decode attention, block copies, and the whole set driving the engine (prefill attention:
test_triton_prefill.py; the shared setup and how the tests run: triton_utils.py)."""

import pytest
import torch
from triton_utils import BOTH, DECODE, DEVICE, GQA, NO_DEVICE, TOL, nan_cache, paged_setup, queries

from pagedserve.kernels import reference
from pagedserve.kernels.triton import cache_ops as tk
from pagedserve.kernels.triton import decode as td

if DEVICE is None:  # pragma: no cover - only when someone unsets the interpreter on a CPU host
    pytest.skip(NO_DEVICE, allow_module_level=True)


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
        k_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
        v_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
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

@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@BOTH
def test_paged_decode_attention(block_size: int, num_heads: int, num_kv_heads: int, dtype,
                                impl: str):
    gen = torch.Generator().manual_seed(1)
    head_dim = 32 if dtype == torch.float32 else 16
    context_lens = [1, block_size - 1, block_size, block_size + 1, 300]
    k_cache, v_cache, table = paged_setup(
        context_lens, block_size, num_kv_heads, head_dim, dtype, gen
    )
    q = queries(len(context_lens), num_heads, num_kv_heads, head_dim, dtype, gen)
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
    k_cache, v_cache, table = paged_setup(context_lens, 16, num_kv_heads, head_dim, dtype, gen)
    q = queries(len(context_lens), num_heads, num_kv_heads, head_dim, dtype, gen)
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
    k_cache, v_cache, table = paged_setup(context_lens, 16, 2, 64, torch.float32, gen)
    spare = int(table[0, -1])  # an all-NaN block
    wide = torch.full((len(context_lens), 16 * table.shape[1]), spare, dtype=torch.int32,
                      device=DEVICE)
    wide[:, : table.shape[1]] = table
    q = queries(len(context_lens), 14, 2, 64, torch.float32, gen)
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
    k_cache, v_cache, table = paged_setup(
        context_lens, block_size, num_kv_heads, head_dim, torch.bfloat16, gen
    )
    q = queries(len(context_lens), num_heads, num_kv_heads, head_dim, torch.bfloat16, gen)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    want = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.2)
    got = DECODE[impl](q, k_cache, v_cache, table, lens, 0.2)
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


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
