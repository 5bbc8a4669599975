"""The C++ CPU kernels (kernels/cpu/*.cpp), compiled on first use and cached.

torch.utils.cpp_extension builds them with the machine's C++ compiler into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); later processes load the
cached library in well under a second. Without a compiler, or with
``PAGEDSERVE_CPU_KERNELS=0``, ``load()`` returns None and the engine serves with the
PyTorch references, which compute the same thing more slowly.
"""

import functools
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedserve.kernels import reference

log = logging.getLogger(__name__)

SOURCES = [str(Path(__file__).parent / "cpu" / name)
           for name in ("module.cpp", "paged.cpp", "elementwise.cpp")]
# -fno-trapping-math lets GCC vectorize the clamps in fast_exp; native code for the CPU
# that builds it (the cache is per machine).
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]


@functools.cache
def load() -> ModuleType | None:
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler: serving with the PyTorch reference kernels")
        return None
    try:
        from torch.utils.cpp_extension import load as build

        # ninja comes from the venv's bin/ when the venv is not activated.
        bin_dir = str(Path(sys.executable).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        return build(name="pagedserve_cpu_ops", sources=SOURCES, extra_cflags=CFLAGS,
                     extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, a build error: serve without them
        log.warning("C++ CPU kernels unavailable, using the PyTorch references: %s", exc)
        return None


# The shapes the C++ decode kernel is instantiated for (kernels/cpu/paged.cpp).
DECODE_HEAD_SIZES = (16, 32, 64, 128)
DECODE_BLOCK_SIZES = (8, 16, 32, 64)
DTYPES = (torch.float32, torch.bfloat16)


def decode_attention(ops: ModuleType):
    """The C++ paged decode attention where it has the shape, else the reference."""

    def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
        if (q.shape[-1] in DECODE_HEAD_SIZES and k_cache.shape[1] in DECODE_BLOCK_SIZES
                and ops.decode_layout_ok(k_cache, v_cache)):
            return ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                              scale)
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                context_lens, scale)

    return paged_decode_attention


@functools.lru_cache(maxsize=256)
def _suffix_mask(n: int, ctx: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive causal mask over absolute positions for the last n of ctx tokens: built once,
    not per layer, and additive so that attention does not convert it on every call."""
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return torch.zeros(n, ctx, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def prefill_attention(ops: ModuleType):
    """Paged prefill as in the reference (PyTorch's fused CPU attention per sequence), with
    each sequence's keys and values gathered by one C++ pass instead of a chain of copies."""

    def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        starts = cu_seqlens_q.tolist()
        group = q.shape[1] // k_cache.shape[2]
        for i, ctx in enumerate(context_lens.tolist()):
            lo, hi = starts[i], starts[i + 1]
            keys, values = ops.gather_kv(k_cache, v_cache, block_tables[i], ctx, group)
            fresh = hi - lo == ctx  # no cached prefix: plain causal attention
            attn = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1)[None], keys[None].to(q.dtype), values[None].to(q.dtype),
                attn_mask=None if fresh else _suffix_mask(hi - lo, ctx, q.dtype), is_causal=fresh,
                scale=scale)
            out[lo:hi] = attn[0].transpose(0, 1)
        return out

    return paged_prefill_attention
