"""The fused Triton elementwise kernels (RMSNorm + residual, RoPE, SwiGLU) against their
PyTorch references: under Triton's interpreter on CPU (tests/conftest.py), on CUDA with
``TRITON_INTERPRET=0`` and a GPU (scripts/gpu-check.sh).

Shapes are odd on purpose (not powers of two), inputs are strided views where the model
passes views, and bf16 runs on CUDA only: the interpreter computes bf16 on raw bits."""

import os

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.triton import elementwise as te

if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
    DTYPES = [torch.float32, torch.float16]
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
    DTYPES = [torch.float32, torch.float16, torch.bfloat16]
else:  # pragma: no cover - only when someone unsets the interpreter on a CPU-only host
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a GPU", allow_module_level=True)

# float32: equal up to the order of operations; 16-bit: up to one rounding step of the output.
TOL = {torch.float32: {"atol": 2e-6, "rtol": 2e-6},
       torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}


def _randn(*shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual: bool) -> None:
    x = _randn(7, 200, dtype=dtype, seed=0) * 3
    weight = _randn(200, dtype=dtype, seed=1)
    residual = _randn(7, 200, dtype=dtype, seed=2) if with_residual else None
    want_res = None if residual is None else residual.clone()
    want = reference.rms_norm(x, want_res, weight, 1e-5)
    got_res = None if residual is None else residual.clone()
    got = te.rms_norm(x, got_res, weight, 1e-5)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    if with_residual:  # the residual stream is updated in place, exactly (one add, rounded)
        torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)


def test_rms_norm_per_head_view() -> None:
    """Qwen3's q/k norm: rows that are heads of a strided slice of the QKV output."""
    qkv = _randn(5, 3 * 4 * 24, dtype=torch.float32, seed=3)
    q = qkv[:, : 4 * 24].reshape(-1, 24)  # a copy: reshape of a strided slice
    weight = _randn(24, dtype=torch.float32, seed=4)
    torch.testing.assert_close(te.rms_norm(q, None, weight, 1e-6),
                               reference.rms_norm(q, None, weight, 1e-6), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_qkv_view(dtype) -> None:
    """Rotates the q and k heads inside the fused QKV buffer and leaves v untouched."""
    num_tokens, q_heads, kv_heads, d = 6, 5, 1, 48
    qkv = _randn(num_tokens, (q_heads + 2 * kv_heads) * d, dtype=dtype, seed=5)
    positions = torch.tensor([0, 3, 9, 10, 31, 2], device=DEVICE)
    freqs = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    want, got = qkv.clone(), qkv.clone()
    reference.rotary_(want[:, : (q_heads + kv_heads) * d].view(num_tokens, -1, d),
                      positions, cos, sin)
    te.rotary_(got[:, : (q_heads + kv_heads) * d].view(num_tokens, -1, d), positions, cos, sin)
    torch.testing.assert_close(got, want, **TOL[dtype])
    v = slice((q_heads + kv_heads) * d, None)
    assert torch.equal(got[:, v], qkv[:, v])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2 * 96, 2 * 1500])  # one tile; several tiles with a tail
def test_silu_and_mul(dtype, width: int) -> None:
    x = _randn(3, width, dtype=dtype, seed=6) * 4
    torch.testing.assert_close(te.silu_and_mul(x), reference.silu_and_mul(x), **TOL[dtype])


def test_empty_inputs() -> None:
    weight = torch.ones(8, device=DEVICE)
    assert te.rms_norm(torch.empty(0, 8, device=DEVICE), None, weight, 1e-5).shape == (0, 8)
    assert te.silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
    te.rotary_(torch.empty(0, 2, 8, device=DEVICE), torch.empty(0, dtype=torch.int64,
               device=DEVICE), torch.ones(4, 4, device=DEVICE), torch.ones(4, 4, device=DEVICE))
