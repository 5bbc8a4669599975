"""How many blocks an engine's KV pool holds, and the check that they fit.

Either a fixed size (``num_kv_blocks``, else ``kv_cache_memory_gib``), or, on CUDA with
``gpu_memory_utilization``, vLLM's rule: the engine may hold that fraction of the GPU's
memory, and the pool gets what is left of it once the weights and a largest step's
activations are in, measured by running such a step on a one-block pool, and then the
sampler over a row per sequence, each asking for all it may (vLLM's dummy sampler run).
What those do not hold comes out of the rest (1 - utilization): the CUDA graphs captured
later (as in vLLM before it profiled them), and prompt logprobs' rows, one per prompt token
of a step (up to the token budget's, in the model's dtype; the sampler widens 1,024 of them
at a time)."""

import logging
from dataclasses import dataclass

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.device_setup import available_memory
from pagedserve.engine.model_runner import ModelRunner, build_model
from pagedserve.engine.sampler import sample
from pagedserve.kernels import KernelSet
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loader import LoadedModel
from pagedserve.models.parallel import TensorParallel
from pagedserve.scheduler import SamplingParams, Sequence

log = logging.getLogger("pagedserve.engine")
GIB = 2**30


def profiles_memory(config: EngineConfig, device: torch.device) -> bool:
    """Whether the pool is sized by a profiled step: gpu_memory_utilization, on CUDA, where
    num_kv_blocks does not fix it (vLLM's CPU backend ignores the flag too)."""
    if config.gpu_memory_utilization is not None and device.type != "cuda":
        log.warning("--gpu-memory-utilization: unused on a CPU; the KV pool is "
                    "--kv-cache-memory-gib or --num-kv-blocks")
    return (config.gpu_memory_utilization is not None and device.type == "cuda"
            and not config.num_kv_blocks)


def fixed_pool_blocks(config: EngineConfig, block_bytes: int) -> int:
    num_blocks = config.num_kv_blocks or int(config.kv_cache_memory_gib * GIB // block_bytes)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-memory-gib {config.kv_cache_memory_gib} holds no KV "
                         f"block ({block_bytes} bytes each)")
    return num_blocks


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory at a moment, in bytes."""

    free: int
    total: int
    torch_reserved: int  # what torch's caching allocator holds, in use or not

    @classmethod
    def now(cls, device: torch.device) -> "GpuMemory":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_reserved(device))

    @property
    def outside_torch(self) -> int:
        """Held outside torch's allocator: CUDA contexts, cuBLAS workspaces, and other
        processes' memory."""
        return self.total - self.free - self.torch_reserved


def requested_bytes(utilization: float, start: GpuMemory) -> int:
    """This engine's share of the GPU. Refused where the GPU has less than that free at
    start (another process holds the rest), as vLLM does: the pool would not fit."""
    requested = int(utilization * start.total)
    if start.free < requested:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} asks for {requested / GIB:.2f} GiB of "
            f"the GPU's {start.total / GIB:.2f} GiB, but only {start.free / GIB:.2f} GiB is "
            "free (other processes hold the rest): lower it")
    return requested


def kv_budget(requested: int, torch_peak: int, start: GpuMemory, end: GpuMemory) -> int:
    """Bytes left for the pool: the engine's share less its torch peak (weights, and the
    activations of the largest step) and what it added outside torch meanwhile (cuBLAS's
    workspaces, Triton's modules; another process's growth would count too)."""
    return requested - torch_peak - max(0, end.outside_torch - start.outside_torch)


def profiled_model_and_pool(loaded: LoadedModel, kernels: KernelSet, config: EngineConfig,
                            dtype: torch.dtype, block_bytes: int, device: torch.device,
                            tp: TensorParallel) -> tuple[LlamaForCausalLM, int]:
    """The model on the GPU, and its pool's blocks under ``config.gpu_memory_utilization``:
    the warm-up's steps (a prefill chunk of the whole token budget beside a decode of the
    model's context) run eagerly on a one-block pool, then the sampler's largest step, and
    their peak is kept out."""
    if config.tensor_parallel_size > 1:
        raise ValueError("--gpu-memory-utilization: not under tensor parallelism (each rank "
                         "would profile its own share); size the pool with "
                         "--kv-cache-memory-gib or --num-kv-blocks")
    start = GpuMemory.now(device)
    requested = requested_bytes(config.gpu_memory_utilization, start)  # before the load
    context = loaded.config.max_position_embeddings
    context = min(config.max_model_len or context, context)  # the pool may lower it later
    model = build_model(loaded, kernels, context, dtype, device, tp)
    return model, _profiled_pool_blocks(model, kernels, config, dtype, context, block_bytes,
                                        device, start, requested)


@torch.inference_mode()
def _profiled_pool_blocks(model: LlamaForCausalLM, kernels: KernelSet, config: EngineConfig,
                          dtype: torch.dtype, max_model_len: int, block_bytes: int,
                          device: torch.device, start: GpuMemory, requested: int) -> int:
    torch.cuda.reset_peak_memory_stats(device)
    runner = ModelRunner(model, kernels, 1, config.block_size, dtype, device)
    runner.warm_up(config.max_num_batched_tokens, max_model_len)
    sample_largest_batch(kernels, config.max_num_seqs, model.config.vocab_size, dtype,
                         device)
    peak, end = torch.cuda.max_memory_allocated(device), GpuMemory.now(device)
    del runner
    torch.cuda.empty_cache()  # the graphs' private pool cannot reuse what torch caches
    budget = kv_budget(requested, peak, start, end)
    log.info("GPU memory: %.2f GiB for this engine (%s of %.2f GiB); %.2f GiB for weights and "
             "a step's peak, %.2f GiB outside torch; %.2f GiB left for the KV pool",
             requested / GIB, config.gpu_memory_utilization, start.total / GIB, peak / GIB,
             (end.outside_torch - start.outside_torch) / GIB, budget / GIB)
    num_blocks = max(0, budget) // block_bytes
    if num_blocks < 1:
        raise ValueError(f"--gpu-memory-utilization {config.gpu_memory_utilization} leaves no "
                         f"memory for the KV pool ({budget / GIB:.2f} GiB once the weights "
                         f"and a step's activations, {peak / GIB:.2f} GiB, are in): raise it, "
                         "or lower --max-num-batched-tokens")
    return num_blocks


def sample_largest_batch(kernels: KernelSet, rows: int, vocab: int, dtype: torch.dtype,
                         device: torch.device) -> None:
    """The sampler's largest step: ``rows`` rows of logits asking for 20 logprobs, with
    penalties, drawn with top-k and top-p but for a greedy row and an unfiltered one (the
    mixed batches copy the rows of each kind), so that the temporaries over the vocabulary
    (float32 logits, log-softmax, probabilities, their sort, a float64 CDF) count. Its
    draws come from a forked RNG: the stream --seed set is left as it was (as vLLM
    re-seeds after its profile)."""
    common = dict(repetition_penalty=1.1, presence_penalty=0.5, logprobs=20)
    kinds = [SamplingParams(temperature=0.0, **common),
             SamplingParams(temperature=0.7, **common),
             SamplingParams(temperature=0.7, top_k=50, top_p=0.9, **common)]
    seqs = [Sequence(f"profile-{i}", [0, 1, 2], kinds[min(i, 2)], 0.0, num_prompt_tokens=2)
            for i in range(rows)]
    logits = torch.zeros(rows, vocab, dtype=dtype, device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        sample(logits, seqs, [None] * rows, argmax_rows=kernels.argmax_rows).to_host()


def check_pool_fits(num_blocks: int, block_bytes: int, device: torch.device) -> None:
    """With the weights in place (on a GPU too), the pool must fit in what is left: refused
    here, not a MemoryError or an OOM kill while it is allocated."""
    free = available_memory(device)
    if free is not None and num_blocks * block_bytes > free:
        raise ValueError(f"a KV cache of {num_blocks} blocks needs "
                         f"{num_blocks * block_bytes / GIB:.2f} GiB, but only "
                         f"{free / GIB:.2f} GiB is available on {device}: lower "
                         "--kv-cache-memory-gib, --num-kv-blocks or --gpu-memory-utilization")
