"""Where an engine runs: the device, its default dtype, block size and token budget, and
the CPU allocator's tuning."""

import ctypes

import torch

from pagedserve.engine.model_runner import bf16_packing_supported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def keep_freed_memory() -> None:
    """Make glibc reuse freed buffers of up to 32 MiB instead of unmapping them: each step
    allocates many same-sized multi-MB tensors (gathered K/V, activations, logits), and a
    fresh mapping costs a page fault per 4 KiB on first touch (2-3x slower attention)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


def resolve_device(name: str) -> torch.device:
    """The device an engine runs on: "auto" is CUDA where available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def default_block_size(device: torch.device) -> int:
    """16 tokens on CUDA (vLLM's default; the Triton kernels were tuned for it), 32 on a CPU:
    the C++ attention takes one online-softmax step per block, whose reductions are serial,
    and 32-token blocks halve them (docs/performance.md §9)."""
    return 16 if device.type == "cuda" else 32


def default_max_num_batched_tokens(device: torch.device) -> int:
    """A step's token budget. 8,192 on CUDA (vLLM's serving default): a step that carries
    prefill chunks runs eagerly, its host cost nearly fixed, so fewer and larger ones win
    (H200, mixed workload: 2.37x the output tok/s of 1,024, docs/performance-gpu.md). 1,024
    on a CPU, whose prefill is compute-bound: a larger chunk only delays the decodes
    batched beside it."""
    return 8192 if device.type == "cuda" else 1024


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        fast_bf16 = device.type == "cuda" or bf16_packing_supported()
        return torch.bfloat16 if fast_bf16 else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto or one of {list(DTYPES)}")
    return DTYPES[name]


def available_memory(device: torch.device) -> int | None:
    """Bytes that new allocations on ``device`` may take: on a GPU the CUDA driver's free
    memory and what torch's caching allocator holds unused (what the load's temporaries
    freed stays there); on a Linux host, MemAvailable, or less where the process's cgroup
    (a container's memory limit) has less left, its reclaimable page cache not counted as
    used (as the kubelet's working set). None where it cannot be told."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    sizes = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            sizes += [int(line.split()[1]) * 1024 for line in f
                      if line.startswith("MemAvailable:")]
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
                used = int(f.read())
            with open("/sys/fs/cgroup/memory.stat", encoding="ascii") as f:
                used -= sum(int(line.split()[1]) for line in f
                            if line.startswith("inactive_file "))
            sizes.append(int(limit) - used)
    except (OSError, ValueError):  # not Linux, or no cgroup v2 files: what was read so far
        pass
    return min(sizes) if sizes else None
