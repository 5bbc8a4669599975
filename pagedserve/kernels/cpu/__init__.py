"""The C++ CPU kernels (the *.cpp here), compiled on first use and cached, and the
KernelSet built on them.

torch.utils.cpp_extension builds them with the machine's C++ compiler into a folder of
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) of this install's own;
later processes load the cached library in well under a second.
``PAGEDSERVE_CPU_KERNELS_LIB`` names a library built ahead of time instead
(``python -m pagedserve.kernels.cpu DIR``, as the Docker image does), which loads with no
compiler present. Without either, or with
``PAGEDSERVE_CPU_KERNELS=0``, ``load()`` returns None and the engine serves with the
PyTorch references, which compute the same thing more slowly.
"""

import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.kernel_set import REFERENCE, KernelSet, kv_cache_zeros

log = logging.getLogger(__name__)

NAME = "pagedserve_cpu_ops"
SOURCES = [str(Path(__file__).parent / name) for name in
           ("module.cpp", "attention.cpp", "paged.cpp", "elementwise.cpp", "linear.cpp")]


def cflags() -> list[str]:
    """-fno-trapping-math lets GCC vectorize the clamps in fast_exp. The target is the CPU
    that builds them (the JIT cache is per machine) unless PAGEDSERVE_CPU_ARCH names a
    portable one (an image built on one machine and run on others)."""
    arch = os.environ.get("PAGEDSERVE_CPU_ARCH", "native")
    return ["-O3", f"-march={arch}", "-fno-trapping-math", "-fno-semantic-interposition",
            "-fopenmp"]


def default_build_directory() -> Path:
    """A folder for this install's sources, flags, Python and torch. torch keys its cache by
    the module's name alone, and ninja rebuilds when a compile line changes: two checkouts
    (or a portable and a native build) sharing it rebuilt each other's library at every
    alternate start, a minute each."""
    key = "|".join([str(Path(__file__).parent.resolve()), *cflags(), sys.version,
                    torch.__version__])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path(cache) / "torch_extensions"
    return Path(root) / f"{NAME}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# A build takes a minute or two; a lock older than this was left by a build that was killed.
STALE_LOCK_S = 600.0


def wait_for_build_lock(build_directory: str, stale_after_s: float = STALE_LOCK_S) -> None:
    """Wait while another process builds here (torch's lock file), and remove a lock that a
    killed build left: torch would wait for it forever, and with it every start after."""
    lock = Path(build_directory) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after_s:
            log.warning("removing %s, left %.0f s ago by a C++ kernel build that did not "
                        "finish", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(min(0.5, stale_after_s - age + 0.01))


def build(build_directory: str | None = None) -> ModuleType:
    from torch.utils.cpp_extension import load as jit_load

    if build_directory is None:
        build_directory = str(default_build_directory())
        os.makedirs(build_directory, exist_ok=True)
    wait_for_build_lock(build_directory)
    # ninja comes from the venv's bin/ when the venv is not activated.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return jit_load(name=NAME, sources=SOURCES, extra_cflags=cflags(),
                    extra_ldflags=["-fopenmp"], build_directory=build_directory)


def _import_prebuilt(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise ImportError(f"no extension module at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load() -> ModuleType | None:
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no",
                                                                         "off"):
        return None
    try:
        if prebuilt := os.environ.get("PAGEDSERVE_CPU_KERNELS_LIB"):
            return _import_prebuilt(prebuilt)
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            log.warning("no C++ compiler: serving with the PyTorch reference kernels")
            return None
        return build()
    except Exception as exc:  # no compiler, no ninja, a build error: serve without them
        log.warning("C++ CPU kernels unavailable, using the PyTorch references: %s", exc)
        return None


# The shapes the C++ attention kernels are instantiated for (attention.cpp).
ATTENTION_HEAD_SIZES = (16, 32, 64, 128)
ATTENTION_BLOCK_SIZES = (8, 16, 32, 64)
DTYPES = (torch.float32, torch.bfloat16)


def _has_kernel(ops: ModuleType, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> bool:
    return (q.shape[-1] in ATTENTION_HEAD_SIZES and k_cache.shape[1] in ATTENTION_BLOCK_SIZES
            and ops.decode_layout_ok(k_cache, v_cache))


def decode_attention(ops: ModuleType):
    """The C++ paged decode attention where it has the shape, else the reference."""

    def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        if _has_kernel(ops, q, k_cache, v_cache):
            return reference.written_to(out, ops.paged_decode_attention(
                q, k_cache, v_cache, block_tables, context_lens, scale))
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                context_lens, scale, out=out)

    return paged_decode_attention


def prefill_attention(ops: ModuleType):
    """The C++ paged prefill attention where it has the shape, else the reference over the
    C++ gather."""

    def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, scale: float,
                                max_query_len: int | None = None,
                                out: torch.Tensor | None = None) -> torch.Tensor:
        if _has_kernel(ops, q, k_cache, v_cache):
            return reference.written_to(out, ops.paged_prefill_attention(
                q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale))
        return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                 cu_seqlens_q, context_lens, scale,
                                                 gather_kv=ops.gather_kv, out=out)

    return paged_prefill_attention


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-major in memory, so that one head's block is contiguous, with key blocks d-major
    ([d, block_size]): the layout the C++ decode kernel reads. The kernels still see
    [L, N, block_size, H, d] views."""
    L, N, bs, H, d = num_layers, num_blocks, block_size, num_kv_heads, head_dim
    v_caches = kv_cache_zeros((L, H, N, bs, d), dtype, device).permute(0, 2, 3, 1, 4)
    k_caches = kv_cache_zeros((L, H, N, d, bs), dtype, device).permute(0, 2, 4, 1, 3)
    return k_caches, v_caches


def use_native_linear(ops: ModuleType) -> bool:
    """Whether float32 linears run on linear.cpp's kernel rather than oneDNN's:
    ``PAGEDSERVE_CPU_LINEAR`` = ``native`` or ``onednn`` decides; unset or ``auto``, the
    native one where PyTorch sees AVX2 as the CPU's widest vectors (AVX2-only CPUs, or
    ``ATEN_CPU_CAPABILITY=avx2``): there oneDNN's AVX2 code is slower, while its AVX-512
    code is faster (docs/performance-linear.md)."""
    choice = os.environ.get("PAGEDSERVE_CPU_LINEAR", "auto")
    if choice not in ("auto", "native", "onednn"):
        raise ValueError(f"PAGEDSERVE_CPU_LINEAR={choice!r}: auto, native or onednn")
    if choice == "native" and not ops.has_linear_f32():
        raise ValueError("PAGEDSERVE_CPU_LINEAR=native: the kernels were built without AVX2")
    return choice == "native" or (choice == "auto" and ops.has_linear_f32()
                                  and torch.backends.cpu.get_cpu_capability() == "AVX2")


def kernel_set(ops: ModuleType | None = None, native_linear: bool | None = None
               ) -> KernelSet | None:
    """The set built on a loaded C++ extension: by default ``load()``'s (None where it is
    unavailable), or another build of the same sources, as scripts/ab_cpu_kernels.py
    compares. native_linear: float32 linears on linear.cpp (True) or oneDNN (False); None,
    as use_native_linear() says."""
    if ops is None:
        ops = load()
    if ops is None:
        return None
    if native_linear is None:
        native_linear = use_native_linear(ops)
    elif native_linear and not ops.has_linear_f32():
        raise ValueError("native float32 linears: the kernels were built without AVX2")
    return dataclasses.replace(
        REFERENCE,
        store_kvcache=ops.store_kvcache,
        paged_decode_attention=decode_attention(ops),
        paged_prefill_attention=prefill_attention(ops),
        rms_norm=ops.rms_norm,
        rotary_=ops.rope_,
        silu_and_mul=ops.silu_and_mul,
        argmax_rows=ops.argmax_rows,
        allocate_kv_cache=allocate_kv_cache,
        pack_linear_f32=ops.pack_linear_f32 if native_linear else None,
        linear_f32=ops.linear_f32 if native_linear else None,
        name="cpu-native",
    )
