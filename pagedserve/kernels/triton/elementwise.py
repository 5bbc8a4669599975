"""Triton kernels for the per-token ops between the matmuls: RMSNorm fused with the
residual add, RoPE in place, and SwiGLU's activation. Each is one launch where PyTorch needs
several (the reference RMSNorm with its residual add is six kernels, RoPE five), and each
rounds exactly where ``kernels/reference.py`` rounds, so results match it bit for bit up to
the order of float32 operations (fused multiply-adds).

One program per token row; a row (a hidden vector, or a token's heads) fits one tile, so
no loop: hidden sizes up to 16K elements.
"""

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton.common import VARYING_POINTERS, pow2

# Rows wider than this would need a loop over tiles; no supported model has one.
_MAX_ROW = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o, n, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # residual += x, rounded to the residual's dtype as PyTorch's add_ does
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    # Normalized, rounded to x's dtype, then scaled by the weight: the reference's two roundings.
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> torch.Tensor:
    """reference.rms_norm: x [rows, hidden]; if residual is given, residual += x first, in
    place, and the sum is normalized."""
    rows, n = x.shape
    if n > _MAX_ROW:
        raise ValueError(f"rms_norm: rows of {n} elements exceed {_MAX_ROW}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    has_residual = residual is not None
    if has_residual and residual.stride(-1) != 1:
        raise ValueError("rms_norm: the residual is updated in place, so it must have unit "
                         "stride along the hidden dimension")
    _rms_norm_kernel[(rows,)](
        x, residual if has_residual else x, weight, out,
        x.stride(0), residual.stride(0) if has_residual else 0, out.stride(0), n, float(eps),
        HAS_RESIDUAL=has_residual, BLOCK=pow2(n), num_warps=_warps(n),
    )
    return out


@triton.jit(do_not_specialize_on_alignment=VARYING_POINTERS)
def _rotary_kernel(
    x_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_xt, stride_xh, stride_cos, stride_sin, num_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_f = tl.arange(0, BLOCK_HALF)
    f_mask = offs_f < half
    mask = (offs_h[:, None] < num_heads) & f_mask[None, :]
    c = tl.load(cos_ptr + pos * stride_cos + offs_f, mask=f_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + offs_f, mask=f_mask, other=0.0)[None, :]
    first = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_f[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """reference.rotary_: x [T, heads, d] rotated in place; x may be a strided view (the q
    and k columns of the fused QKV output) as long as each head's d values are contiguous."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    if x.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("rotary_: head_dim and the cos/sin rows must be contiguous")
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        num_heads, half, BLOCK_H=pow2(num_heads), BLOCK_HALF=pow2(half),
        num_warps=_warps(num_heads * head_dim),
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0).to(tl.float32)
    # silu(gate) rounded to the dtype first, as F.silu returns it, then the product.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty),
             mask=mask)


_SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """reference.silu_and_mul: [T, 2 * I] = [gate | up] -> silu(gate) * up, [T, I]."""
    rows, width = x.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    block = min(_SILU_BLOCK, pow2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out


def _warps(elements: int) -> int:
    """Warps for a one-row tile: about 256 elements per warp, 1 to 16 warps."""
    return max(1, min(16, pow2(elements) // 256))
