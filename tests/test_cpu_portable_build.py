"""The C++ kernels built for x86-64-v3 (AVX2 and FMA, no AVX-512): the Docker image's target,
and the widest vectors of many rented CPUs. There float32 attention runs on f32_tiles.h's
AVX2 tiles, which a native build on an AVX-512 host never compiles: here they are held to
the references, and to the invariants chunked = whole and forked = independent rest on (a
row's result does not depend on the rows it is computed with). On an AVX-512 host the native
build must also give the same float32 attention bits as this one."""

from types import ModuleType

import pytest
import torch
from test_cpu_kernels import TOL, _decode_case, _prefill_case, decode_each_row

from pagedserve.kernels import cpu, reference

ops = cpu.load()
pytestmark = [
    pytest.mark.skipif(ops is None, reason="the C++ CPU kernels did not build"),
    pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                       reason="the host cannot run x86-64-v3 code"),
]


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> ModuleType:
    """A build for x86-64-v3 under its own module name: Python hands back the module it
    already loaded for a second extension of the same name, whatever its file."""
    from torch.utils.cpp_extension import load as jit_load

    flags = [f for f in cpu.cflags() if not f.startswith("-march=")] + ["-march=x86-64-v3"]
    return jit_load(name=f"{cpu.NAME}_x86_64_v3", sources=cpu.SOURCES, extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(tmp_path_factory.mktemp("x86-64-v3")))


@pytest.mark.parametrize(("bs", "heads", "kv_heads", "d"), [
    (16, 9, 3, 64), (8, 4, 4, 32), (32, 8, 2, 128), (64, 6, 1, 16)])
def test_decode_attention(v3, bs, heads, kv_heads, d):
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 300]
    q, k_cache, v_cache, tables, ctx = _decode_case(lens, bs, heads, kv_heads, d, torch.float32)
    got = v3.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d**-0.5)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d**-0.5)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_decode_attention_over_shared_blocks(v3):
    """Rows on one prefix go through the tiles of several queries (up to six at once); each
    row still equals itself computed alone."""
    bs, heads, kv_heads, d = 16, 9, 3, 64
    lens = [70, 70, 90, 40, 130, 70] * 3 + [64, 66, 50]
    q, k_cache, v_cache, tables, ctx = _decode_case(lens, bs, heads, kv_heads, d, torch.float32,
                                                    seed=3)
    for i, n in enumerate(lens[:20]):
        shared = 5 if n == 70 else min(4, n // bs)
        tables[i, :shared] = tables[0, :shared]
    got = v3.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d**-0.5)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d**-0.5)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    alone = torch.cat([v3.paged_decode_attention(q[i : i + 1], k_cache, v_cache,
                                                 tables[i : i + 1], ctx[i : i + 1], d**-0.5)
                       for i in range(len(lens))])
    assert torch.equal(got, alone)


@pytest.mark.parametrize(("bs", "heads", "kv_heads", "d"), [(16, 9, 3, 64), (32, 8, 2, 128)])
def test_prefill_attention_and_its_decode(v3, bs, heads, kv_heads, d):
    """Fresh prompts and chunks over a cached prefix; then each prefilled row against the
    decode kernel on that row (chunked = whole rests on their equality)."""
    lens, new = [40, bs + 1, 3 * bs, 75, 300, 2], [40, bs + 1, 5, 1, 120, 2]
    q, k_cache, v_cache, tables, cu, ctx = _prefill_case(lens, new, bs, heads, kv_heads, d,
                                                         torch.float32)
    tables[4, :2] = tables[3, :2]  # a prefix shared with another sequence
    scale = d**-0.5
    got = v3.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, scale)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, scale)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert torch.equal(got, decode_each_row(v3, q, k_cache, v_cache, tables, cu, ctx, scale))


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="the native build has AVX-512 forms only on an AVX-512 host")
@pytest.mark.parametrize("bs", [16, 32, 64])
def test_native_attention_equals_the_avx2_build_bit_for_bit(v3, bs):
    """On an AVX-512 host the native build's online softmax runs 16 lanes a vector (partial
    blocks under masks), the x86-64-v3 build's 8 (full blocks) and scalar loops: the same
    operations in the same order, so float32 attention is the same to the bit."""
    heads, kv_heads, d = 9, 3, 64
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 300]
    q, k_cache, v_cache, tables, ctx = _decode_case(lens, bs, heads, kv_heads, d, torch.float32)
    assert torch.equal(ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125),
                       v3.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125))
    lens, new = [40, bs + 1, 3 * bs, 75, 300, 2], [40, bs + 1, 5, 1, 120, 2]
    q, k_cache, v_cache, tables, cu, ctx = _prefill_case(lens, new, bs, heads, kv_heads, d,
                                                         torch.float32)
    assert torch.equal(ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 0.125),
                       v3.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 0.125))
