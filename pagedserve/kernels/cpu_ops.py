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

from pagedserve.kernels import reference

log = logging.getLogger(__name__)

SOURCES = [str(Path(__file__).parent / "cpu" / name)
           for name in ("module.cpp", "paged.cpp", "elementwise.cpp")]
# -fno-trapping-math lets GCC vectorize the clamps in fast_exp; native code for the CPU
# that builds it (the cache is per machine).
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fno-semantic-interposition", "-fopenmp"]


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

