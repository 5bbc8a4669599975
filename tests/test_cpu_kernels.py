"""The C++ CPU kernels (kernels/cpu/) against their PyTorch references.

They compile on first use (tens of seconds, once per machine); without a C++ compiler the
engine falls back to the references and these tests are skipped.
"""

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, intra_op_threads, make_engine, prompts_of_lengths, run

from pagedserve.kernels import REFERENCE, cpu, kernels_for, reference

ops = cpu.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ CPU kernels did not build")

DTYPES = [torch.float32, torch.bfloat16]
# bf16 inputs, fp32 arithmetic inside both: the difference is the reference's bf16 matmul
# rounding (scores and probabilities), a few bf16 ulps of outputs of magnitude ~1.
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _caches(num_blocks: int, bs: int, heads: int, d: int, dtype: torch.dtype, gen):
    """Key blocks d-major, value blocks row-major, one head's block contiguous (the engine's
    layout), every slot poisoned with NaN so that a read past a context shows up."""
    k = torch.randn(heads, num_blocks, d, bs, generator=gen).to(dtype)
    v = torch.randn(heads, num_blocks, bs, d, generator=gen).to(dtype)
    return k.permute(1, 3, 0, 2), v.permute(1, 2, 0, 3)


def _decode_case(lens, bs, heads, kv_heads, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / bs) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache, v_cache = _caches(num_blocks, bs, kv_heads, d, dtype, gen)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):  # write real K/V only into each sequence's live slots
        row = [ids.pop() for _ in range(blocks_per_seq[i])]
        tables[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        for pos in range(n):
            b, off = row[pos // bs], pos % bs
            k_cache[b, off] = torch.randn(kv_heads, d, generator=gen).to(dtype)
            v_cache[b, off] = torch.randn(kv_heads, d, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bs", "heads", "kv_heads", "d"), [
    (16, 9, 3, 64), (8, 4, 4, 32), (32, 8, 2, 128), (64, 6, 1, 16), (16, 14, 2, 64)])
def test_decode_attention_matches_reference(dtype, bs, heads, kv_heads, d):
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 300]
    q, k_cache, v_cache, tables, ctx = _decode_case(lens, bs, heads, kv_heads, d, dtype)
    assert ops.decode_layout_ok(k_cache, v_cache)
    scale = d**-0.5
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_over_shared_blocks(dtype):
    """Forked samples and requests on one cached prefix read the same physical blocks: the
    kernel loads such a block once for all of them. Rows 0-19 share prefix blocks (more rows
    than one cluster holds), sharing 5, 4 or 2 blocks (the 5th partial, as right after a
    fork), with private tails of different lengths; row 20 stands alone. Each row must match
    the reference, and be bit-identical to the same row computed on its own."""
    bs, heads, kv_heads, d = 16, 9, 3, 64
    lens = [70, 70, 90, 40, 130, 70] * 3 + [64, 66, 50]
    q, k_cache, v_cache, tables, ctx = _decode_case(lens, bs, heads, kv_heads, d, dtype, seed=3)
    for i, n in enumerate(lens[:20]):
        shared = 5 if n == 70 else min(4, n // bs)
        tables[i, :shared] = tables[0, :shared]
    scale = d**-0.5
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    alone = torch.cat([ops.paged_decode_attention(q[i : i + 1], k_cache, v_cache,
                                                  tables[i : i + 1], ctx[i : i + 1], scale)
                       for i in range(len(lens))])
    assert torch.equal(got, alone)


def test_decode_attention_test_catches_an_off_by_one():
    """Test the test: one key too few (context_len - 1) must fail the comparison."""
    q, k_cache, v_cache, tables, ctx = _decode_case([5, 40, 17], 16, 4, 2, 32, torch.float32)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2)
    short = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx - 1, 0.2)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(short, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_decode_attention_falls_back_for_other_shapes():
    """Head size 24 has no C++ instantiation: the wrapper serves it with the reference."""
    q, k_cache, v_cache, tables, ctx = _decode_case([7, 20], 16, 4, 2, 24, torch.float32)
    with pytest.raises(RuntimeError, match="head size"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.3)
    run = cpu.decode_attention(ops)
    torch.testing.assert_close(
        run(q, k_cache, v_cache, tables, ctx, 0.3),
        reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.3))


def _prefill_case(lens, new, bs, heads, kv_heads, d, dtype, seed=7):
    """Each sequence's query is the last new[i] of its lens[i] keys (a fresh prompt where
    they are equal, a chunk over a cached prefix where not); every slot past a context is
    NaN."""
    _, k_cache, v_cache, tables, ctx = _decode_case(lens, bs, heads, kv_heads, d, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(new), heads, d, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, cu, ctx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bs", "heads", "kv_heads", "d"), [
    (16, 9, 3, 64), (8, 4, 4, 32), (32, 8, 2, 128), (64, 6, 1, 16)])
def test_prefill_attention_matches_reference(dtype, bs, heads, kv_heads, d):
    """Fresh prompts (one longer than a cluster of rows) and chunks over a cached prefix,
    in one batch."""
    lens, new = [40, bs + 1, 3 * bs, 75, 300, 2], [40, bs + 1, 5, 1, 120, 2]
    q, k_cache, v_cache, tables, cu, ctx = _prefill_case(lens, new, bs, heads, kv_heads, d,
                                                         dtype)
    scale = d**-0.5
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, scale)
    got = ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_token_equals_its_decode(dtype):
    """A prefilled token is computed exactly as decoding it would be (which is what makes
    chunked = whole and preempted = uninterrupted hold bit for bit): each query row of a
    prefill equals the decode kernel on that row with the keys up to its position, also
    where sequences share their first blocks (one cached prefix)."""
    bs, heads, kv_heads, d = 16, 9, 3, 64
    lens, new = [70, 70, 37], [70, 22, 37]
    q, k_cache, v_cache, tables, cu, ctx = _prefill_case(lens, new, bs, heads, kv_heads, d,
                                                         dtype, seed=11)
    tables[1, :3] = tables[0, :3]  # sequence 1's 48 cached keys are sequence 0's
    got = ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, d**-0.5)
    assert torch.equal(got, decode_each_row(ops, q, k_cache, v_cache, tables, cu, ctx, d**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_is_the_same_on_two_threads(dtype):
    """The engine runs on every core (the suite on one): the kernels' threads take parts of
    the work from a queue, and any thread's part must come out as one thread's would,
    every row computed once."""
    bs, heads, kv_heads, d = 16, 9, 3, 64
    lens = [70, 3, 90, 40, 130, 17] * 5
    q, k_cache, v_cache, tables, ctx = _decode_case(lens, bs, heads, kv_heads, d, dtype, seed=5)
    lens_p, new = [40, bs + 1, 3 * bs, 75, 300, 2] * 2, [40, bs + 1, 5, 1, 120, 2] * 2
    pq, pk, pv, ptables, cu, pctx = _prefill_case(lens_p, new, bs, heads, kv_heads, d, dtype)

    def both():
        return (ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d**-0.5),
                ops.paged_prefill_attention(pq, pk, pv, ptables, cu, pctx, d**-0.5))

    one = both()
    with intra_op_threads(2):
        two = both()
    assert torch.isfinite(one[0]).all() and torch.isfinite(one[1]).all()
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def decode_each_row(ops, q, k_cache, v_cache, tables, cu, ctx, scale):
    """The decode kernel on each prefill query row, with the keys up to its position."""
    new = cu.diff()
    seq_of_row = torch.repeat_interleave(torch.arange(len(new)), new)
    first = cu[:-1].long()[seq_of_row]
    row_lens = ctx[seq_of_row] - new[seq_of_row] + 1 + torch.arange(len(q)) - first
    return ops.paged_decode_attention(q, k_cache, v_cache, tables[seq_of_row], row_lens.int(),
                                      scale)


def test_prefill_attention_test_catches_a_causal_leak():
    """Test the test: every query row reading one key past its position must fail."""
    q, k_cache, v_cache, tables, cu, ctx = _prefill_case([40, 30], [40, 12], 16, 4, 2, 32,
                                                         torch.float32)
    k_cache.nan_to_num_(0.0), v_cache.nan_to_num_(0.0)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 0.2)
    seq_of_row = torch.tensor([0] * 40 + [1] * 12)
    pos = torch.cat([torch.arange(40), torch.arange(18, 30)])
    leaky = ops.paged_decode_attention(q, k_cache, v_cache, tables[seq_of_row],
                                       (pos + 2).int().clamp(max=ctx[seq_of_row]), 0.2)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(leaky, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_falls_back_to_the_cpp_gather(dtype):
    """Head size 24 has no C++ attention: the kernel set serves it with the reference over
    the C++ gather, which repeats each KV head for the query heads that read it."""
    bs, heads, kv_heads, d = 8, 4, 2, 24
    q, k_cache, v_cache, tables, cu, ctx = _prefill_case([40, 9, 24, 75], [40, 9, 5, 1], bs,
                                                         heads, kv_heads, d, dtype)
    scale = d**-0.5
    with pytest.raises(RuntimeError, match="head size"):
        ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, scale)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, scale)
    got = cpu.prefill_attention(ops)(q, k_cache, v_cache, tables, cu, ctx, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    keys, values = ops.gather_kv(k_cache, v_cache, tables[3], 75, heads // kv_heads)
    assert keys.shape == values.shape == (heads, 75, d)
    blocks = tables[3, : -(-75 // bs)].long()  # query head `group` reads KV head 1
    by_head = k_cache[blocks].permute(2, 0, 1, 3).reshape(kv_heads, -1, d)
    torch.testing.assert_close(keys[heads // kv_heads], by_head[1, :75])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [7, 70])  # 70: split over threads, with prefetches ahead
def test_store_kvcache_matches_reference(dtype, tokens):
    gen = torch.Generator().manual_seed(1)
    k_ref, v_ref = _caches(6, 16, 3, 32, dtype, gen)
    k_ref.zero_()
    v_ref.zero_()
    k_got, v_got = k_ref.clone(), v_ref.clone()  # clone keeps the strides
    qkv = torch.randn(tokens, 3 * 3 * 32, generator=gen).to(dtype)  # key/value: strided views
    key = qkv[:, 32 * 3 : 64 * 3].view(tokens, 3, 32)
    value = qkv[:, 64 * 3 :].view(tokens, 3, 32)
    slots = torch.randperm(6 * 16, generator=gen)[:tokens]  # scattered, as decodes are
    slots[2::5] = -1
    reference.store_kvcache(key, value, k_ref, v_ref, slots)
    with intra_op_threads(2):
        ops.store_kvcache(key, value, k_got, v_got, slots)
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)
    written = int((slots >= 0).sum())
    assert k_got.count_nonzero() == written * 3 * 32  # the -1 slots wrote nothing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_matches_reference(dtype, rows):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    res = torch.randn(rows, 576, generator=gen).to(dtype)
    res_ref, res_got = res.clone(), res.clone()
    want = reference.rms_norm(x, res_ref, weight, 1e-5)
    got = ops.rms_norm(x, res_got, weight, 1e-5)
    assert torch.equal(res_got, res_ref)  # residual += x, rounded the same way
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(ops.rms_norm(x, None, weight, 1e-5),
                               reference.rms_norm(x, None, weight, 1e-5),
                               atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference_in_place_on_a_strided_view(dtype):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(11, (4 + 2 + 2) * 16, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 8, 9, 100, 101, 5, 3, 2047])
    freqs = torch.outer(torch.arange(2048.0), torch.rand(8, generator=gen))
    cos, sin = freqs.cos(), freqs.sin()
    want, got = qkv.clone(), qkv.clone()
    reference.rotary_(want[:, : 6 * 16].view(11, 6, 16), positions, cos, sin)
    ops.rope_(got[:, : 6 * 16].view(11, 6, 16), positions, cos, sin)
    assert torch.equal(got[:, 6 * 16 :], qkv[:, 6 * 16 :])  # v untouched
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="rotary table"):
        ops.rope_(got[:, :16].view(11, 1, 16), positions + 1, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bit_identical_to_reference_at_scale(dtype):
    """Each product rounded before the sum, as eagerly: a fused multiply-add differs in the
    last bit about once in 60,000 values, which flipped a greedy token in bf16."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4096, 12, 64, generator=gen).to(dtype)
    freqs = torch.outer(torch.arange(4096.0), 1e5 ** -(torch.arange(0, 64, 2) / 64))
    want, got = x.clone(), x.clone()
    reference.rotary_(want, torch.arange(4096), freqs.cos(), freqs.sin())
    ops.rope_(got, torch.arange(4096), freqs.cos(), freqs.sin())
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 2 * 200, generator=gen).to(dtype) * 6  # tails where exp over/underflows
    x[0, 0], x[0, 1] = 100.0, -100.0
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x),
                               atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 256, 257, 1000, 49152])
def test_argmax_rows_matches_reference(dtype, n):
    """The first maximum, also when equal maxima sit in different chunks of the kernel's
    scan (it reads 256 at a time); a NaN counts as the maximum, the first NaN winning."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(12, n, generator=gen).to(dtype)
    x[1] = 1.0  # all equal: index 0
    x[2] = float("-inf")
    x[3, -1] = 100.0
    if n > 300:
        x[4, 10] = x[4, 270] = x[4, n - 1] = 50.0  # a tie across chunks
        x[5, 280], x[5, 20] = float("nan"), float("nan")
        x[6, 299] = x[6, 300] = float("inf")
        x[7, n // 2] = float("nan")
    want = reference.argmax_rows(x)
    assert torch.equal(ops.argmax_rows(x), want)
    wide = torch.cat([x, x.flip(1)], dim=1)[:, :n]  # rows with a stride of 2n
    assert torch.equal(ops.argmax_rows(wide), want)


def test_a_prebuilt_library_loads_without_a_compiler(tmp_path):
    """PAGEDSERVE_CPU_KERNELS_LIB (the Docker image's prebuilt kernels) loads with no
    compiler on PATH; a missing file falls back to the references instead of failing."""
    script = ("from pagedserve.kernels import cpu; ops = cpu.load(); "
              "print(ops is not None and hasattr(ops, 'paged_decode_attention'))")

    def loads(lib: str) -> str:
        env = dict(os.environ, PAGEDSERVE_CPU_KERNELS_LIB=lib, CXX=str(tmp_path / "no-cxx"),
                   TORCH_EXTENSIONS_DIR=str(tmp_path / "empty-cache"))
        p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    assert loads(ops.__file__) == "True"
    assert loads(str(tmp_path / "missing.so")) == "False"
    assert not (tmp_path / "empty-cache").exists()  # nothing was compiled


def test_each_install_and_target_builds_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """The JIT cache is per checkout and per target (torch's default keys it by the module's
    name alone, so two checkouts rebuilt each other's library at every other start), under
    $TORCH_EXTENSIONS_DIR; the same install and flags find the same folder again."""
    if not os.environ.get("PAGEDSERVE_CPU_KERNELS_LIB"):  # the library these tests run
        assert Path(ops.__file__).parent == cpu.default_build_directory()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = cpu.default_build_directory()
    assert here.parent == tmp_path and here == cpu.default_build_directory()
    monkeypatch.setenv("PAGEDSERVE_CPU_ARCH", "x86-64-v3")
    assert cpu.default_build_directory() != here
    monkeypatch.delenv("PAGEDSERVE_CPU_ARCH")
    monkeypatch.setattr(cpu, "__file__", str(tmp_path / "other-checkout" / "__init__.py"))
    assert cpu.default_build_directory() != here


def test_a_lock_left_by_a_killed_build_is_removed_a_live_ones_awaited(tmp_path):
    """torch's build lock (a file) outlives a build that was killed, and torch then waits for
    it forever. A lock past its age is removed; a younger one is waited for until it goes."""
    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 700, time.time() - 700))
    cpu.wait_for_build_lock(str(tmp_path))  # 600 s: stale
    assert not lock.exists()
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()  # the other build finishes
    started = time.monotonic()
    cpu.wait_for_build_lock(str(tmp_path), stale_after_s=30)
    assert 0.25 < time.monotonic() - started < 5
    lock.touch()  # a build killed just now: waited for until it is stale
    started = time.monotonic()
    cpu.wait_for_build_lock(str(tmp_path), stale_after_s=1.0)
    assert not lock.exists() and 0.9 < time.monotonic() - started < 5


def test_kernels_for_cpu_picks_the_native_set_and_reference_on_request():
    host = torch.device("cpu")
    assert kernels_for(host, torch.float32).name == "cpu-native"
    assert kernels_for(host, torch.float32, native=False) is REFERENCE
    assert kernels_for(host, torch.float16) is REFERENCE  # the C++ ops take fp32/bf16 only


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_set_allocates_its_cache_layout(dtype):
    """The native set: head-major memory, key blocks d-major (what its decode kernel
    reads); the references: block-major. Both zeroed, both [L, N, block_size, H, d]."""
    host, shape = torch.device("cpu"), (2, 5, 16, 3, 32)
    k, v = kernels_for(host, dtype).allocate_kv_cache(*shape, dtype, host)
    assert k.shape == v.shape == shape and k.dtype == v.dtype == dtype
    L, N, bs, H, d = shape
    assert k.stride() == (H * N * d * bs, d * bs, 1, N * d * bs, bs)
    assert v.stride() == (H * N * bs * d, bs * d, d, N * bs * d, 1)
    assert ops.decode_layout_ok(k[1], v[1])
    assert not k.any() and not v.any()
    k, v = REFERENCE.allocate_kv_cache(*shape, dtype, host)
    assert k.shape == v.shape == shape and k.is_contiguous() and v.is_contiguous()
    assert not k.any() and not v.any()


def test_engine_with_native_kernels_equals_reference_engine(embedded):
    """Greedy tokens of the embedded model, native kernels vs the references (fp32), with
    prefills (one chunked) and decodes in the same steps."""
    prompts = prompts_of_lengths([3, 17, 40, 90])

    def tokens(engine):
        return [o.outputs[0].token_ids for o in run(engine, prompts, greedy(24))]

    native = make_engine(embedded, max_num_batched_tokens=64)
    assert native.runner.kernels.name == "cpu-native"
    ref = make_engine(embedded, max_num_batched_tokens=64, native_kernels=False)
    assert ref.runner.kernels is REFERENCE
    assert tokens(native) == tokens(ref)


@pytest.mark.parametrize("value", ["0", "false", "No", "off"])
def test_the_kernels_can_be_turned_off_by_env(monkeypatch, value):
    from pagedserve.kernels import cpu

    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", value)
    assert cpu.load.__wrapped__() is None
