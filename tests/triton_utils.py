"""What the Triton kernel tests share: the device they run on, tolerances, and paged
caches in which a missing mask or a wrong block lookup shows.

The tests run on CPU under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before the kernels are imported), or with ``TRITON_INTERPRET=0`` and a GPU on CUDA
(scripts/gpu-check.sh). The interpreter costs ~0.1 ms per Triton op, so shapes stay small.

Caches are filled with NaN everywhere a sequence does not own a token, and block tables use
shuffled, non-contiguous physical block ids, so a missing mask or a wrong block lookup shows
up as NaN or as a mismatch.
"""

import math
import os

import pytest
import torch

from pagedserve.kernels.triton import basic
from pagedserve.kernels.triton import decode as td
from pagedserve.kernels.triton import prefill as tp

# Both attention versions (pagedserve.kernels.triton.ATTENTION), for the tests they share.
DECODE = {"basic": basic.paged_decode_attention, "flash": td.paged_decode_attention}
PREFILL = {"basic": basic.paged_prefill_attention, "flash": tp.paged_prefill_attention}
BOTH = pytest.mark.parametrize("impl", ["basic", "flash"])
GQA = [(4, 2), (2, 2), (14, 2)]  # (num_heads, num_kv_heads): groups 2, 1 and 7 (Qwen2.5)

DEVICE: torch.device | None = None  # None: neither; the test modules skip
if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
NO_DEVICE = "Triton kernels need TRITON_INTERPRET=1 or a GPU"


TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def nan_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype):
    return torch.full(
        (num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE
    )


def paged_setup(
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
    k_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    v_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    for i, n in enumerate(context_lens):
        for j in range(need[i]):
            block = perm.pop()
            table[i, j] = block
            used = min(block_size, n - j * block_size)
            shape = (used, num_kv_heads, head_dim)
            k_cache[block, :used] = torch.randn(shape, generator=gen).to(DEVICE, dtype)
            v_cache[block, :used] = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return k_cache, v_cache, table.to(DEVICE)


def queries(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, gen):
    """q as a strided slice of a fused qkv tensor, as a model produces it."""
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv.to(DEVICE, dtype)[:, :num_heads]

