"""linear.cpp's float32 linear layers: right to float32 rounding, a row's result independent
of its batch, and the engine using them where the kernel set says so."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from engine_utils import intra_op_threads, make_engine, run

from pagedserve.engine import SamplingParams
from pagedserve.kernels import cpu
from pagedserve.models.llama import PackedLinear

ops = cpu.load()
pytestmark = pytest.mark.skipif(ops is None or not ops.has_linear_f32(),
                                reason="C++ kernels without AVX2/FMA (or not built)")


# Rows, K and N off the tiles' multiples (4 rows, 24 columns), with and without a bias.
@pytest.mark.parametrize("rows, k, n, bias", [
    (1, 576, 960, False), (5, 577, 50, True), (64, 576, 3072, False), (130, 1536, 576, True),
    (3, 5, 1, True), (1030, 64, 24, False)])
def test_linear_matches_float64_to_float32_rounding(rows, k, n, bias):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = ops.linear_f32(x, ops.pack_linear_f32(w), b, n)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # Sequential float32 sums of k products of unit normals: error grows like sqrt(k) ulps.
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * k)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads():
    """Each output is one in-order sum over k: the same bits alone, in any batch, at any
    position in a tile and on any number of threads (chunked = whole rests on it)."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(67, 576, generator=gen), torch.randn(1000, 576, generator=gen)
    packed = ops.pack_linear_f32(w)
    with intra_op_threads(2):  # the suite runs on one thread
        whole = ops.linear_f32(x, packed, None, 1000)
    for lo, hi in ((0, 1), (3, 4), (5, 9), (6, 67), (66, 67)):
        assert torch.equal(ops.linear_f32(x[lo:hi], packed, None, 1000), whole[lo:hi])
    assert torch.equal(ops.linear_f32(x, packed, None, 1000), whole)


def test_linear_takes_leading_dimensions_and_strided_rows():
    gen = torch.Generator().manual_seed(2)
    wide, w = torch.randn(2, 7, 100, generator=gen), torch.randn(30, 64, generator=gen)
    x = wide[..., :64]  # rows 100 apart
    got = ops.linear_f32(x, ops.pack_linear_f32(w), None, 30)
    assert got.shape == (2, 7, 30)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_refused():
    packed = ops.pack_linear_f32(torch.randn(30, 64))
    with pytest.raises(RuntimeError, match="packed weight's K"):
        ops.linear_f32(torch.randn(2, 63), packed, None, 30)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_f32(torch.randn(2, 64), packed, torch.randn(29), 30)
    with pytest.raises(RuntimeError, match="float32"):
        ops.pack_linear_f32(torch.randn(30, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("choice, native", [("native", True), ("onednn", False)])
def test_the_environment_picks_the_float32_linears(monkeypatch, choice, native):
    monkeypatch.setenv("PAGEDSERVE_CPU_LINEAR", choice)
    assert (cpu.kernel_set(ops).linear_f32 is not None) is native


def test_auto_picks_them_where_pytorch_sees_avx2_at_most(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_CPU_LINEAR", raising=False)
    avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert (cpu.kernel_set(ops).linear_f32 is not None) is avx2
    # Capped to AVX2 (as on an AVX2-only CPU), in a fresh process: native.
    code = ("from pagedserve.kernels import cpu; "
            "print(cpu.kernel_set().linear_f32 is not None)")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "True"


def test_an_unknown_linear_choice_is_refused(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="auto, native or onednn"):
        cpu.kernel_set(ops)


def test_engine_on_native_linears_decodes_as_on_onednn(embedded):
    """Every linear and the lm_head on linear.cpp; greedy tokens as with oneDNN's linears
    (HF agreement on these kernels: test_hf_agreement.py)."""
    native = make_engine(embedded, kernels=cpu.kernel_set(ops, native_linear=True))
    packed = [m for m in native.model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * embedded.config.num_layers + 1  # and the lm_head
    assert all(m.native is not None for m in packed)
    onednn = make_engine(embedded, kernels=cpu.kernel_set(ops, native_linear=False))
    prompts = [embedded.tokenizer.encode(p) for p in
               ("The capital of France is", "def add(a, b):\n    return", "1, 2, 3, 4,")]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in run(native, prompts, params)]
    want = [o.outputs[0].token_ids for o in run(onednn, prompts, params)]
    assert got == want
