"""The engine's settings (EngineConfig), and how a device fills the ones left to it."""

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedserve.engine.device_setup import default_block_size, default_max_num_batched_tokens
from pagedserve.models import generation_config
from pagedserve.models.generation_config import SamplingDefaults
from pagedserve.models.reasoning import PARSERS as REASONING_PARSERS
from pagedserve.scheduler import InvalidRequest, SamplingParams

log = logging.getLogger("pagedserve.engine")


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None: the embedded SmolLM2
    dtype: str = "auto"  # auto: bfloat16 where the device has fast bf16 matmul, else float32
    block_size: int | None = None  # tokens per KV block; None: default_block_size(device)
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gib
    kv_cache_memory_gib: float = 2.0
    # CUDA: the fraction of the GPU's memory this engine may hold, weights, activations and
    # pool together; the pool gets what a profiled step leaves (vLLM's flag; engine/kv_pool.py).
    # None: the pool is kv_cache_memory_gib. Unused on a CPU; num_kv_blocks wins over it.
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None  # None: default_max_num_batched_tokens(device)
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's context, capped by the pool
    enable_prefix_caching: bool = True
    device: str = "auto"
    num_threads: int | None = None  # CPU intra-op threads; None: PyTorch's default
    native_kernels: bool = True  # CPU: the C++ kernels (built on first use); False: PyTorch
    # CUDA: "flash" (tensor cores, split-KV, fused RMSNorm/RoPE/SwiGLU) or "basic" (the
    # first kernels, kept as a baseline); both pass scripts/gpu-check.sh on an H200.
    triton_attention: str = "flash"
    # Decode-only steps replay CUDA graphs (engine/cuda_graphs.py) unless this is True.
    # None: graphs on CUDA, eager on CPU (where the padded path only costs). False forces
    # the graph path, run uncaptured on CPU (that is how the CPU tests check it).
    enforce_eager: bool | None = None
    # Where graphs run, the steps that carry prefill chunks replay them too, piecewise:
    # all but attention, per padded token count (engine/piecewise_graphs.py). None: on
    # CUDA (its tests passed on an H200, 2026-12-04), off on CPU.
    piecewise_graphs: bool | None = None
    # Those steps replay one whole graph each instead, attention included (its flat grid;
    # the "flash" kernels or the references). Off until its tests pass on a GPU.
    full_graphs: bool = False
    # Schedule and launch each step before reading back the previous step's tokens, which
    # the new step takes as input ids on the device (engine/in_flight.py): the host's
    # bookkeeping then overlaps the GPU's forward. One rank only. None: on CUDA (its tests
    # passed on an H200, 2026-12-04), off on CPU (which does not gain).
    async_scheduling: bool | None = None
    # vLLM's --scheduling-policy: "fcfs" (first come, first served; a request's priority is
    # taken and unused, as in vLLM) or "priority" (lower values first, arrival breaking ties).
    scheduling_policy: str = "fcfs"
    # Ranks the model is split over (Megatron-style; engine/distributed.py): rank 0 is this
    # process, the others are spawned here or started by torchrun, and load ``model``
    # themselves (a ``loaded`` given to LLMEngine must be that model).
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0  # a step's collectives fail after this long
    # A streamed (DELTA) request's delta waits until it holds this many new tokens (its
    # first token and its last go at once): fewer, larger chunks for every layer above
    # (vLLM's and SGLang's --stream-interval).
    stream_interval: int = 1
    # A Jinja chat template in place of the model's own (vLLM's --chat-template, which also
    # takes a file: the CLI reads it).
    chat_template: str | None = None
    # vLLM's --reasoning-parser (models/reasoning.py): "qwen3" or "deepseek_r1" for a model
    # that thinks between <think> and </think>: a request's structured-output constraint
    # then applies after the thinking, and the server splits the thinking from the answer.
    reasoning_parser: str | None = None
    # Sampling defaults for the fields a request leaves out (vLLM's --generation-config):
    # "auto" the model's generation_config.json (a GGUF's general.sampling.* keys), "vllm"
    # none, or a directory holding a generation_config.json. The override (that file's
    # names: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) goes on top.
    generation_config: str = "auto"
    seed: int | None = None  # seeds unseeded requests' draws (vLLM's --seed); None: unseeded
    override_generation_config: dict[str, Any] | None = None


def resolve_config(config: EngineConfig, device: torch.device) -> EngineConfig:
    """The config as an engine on ``device`` runs it: each None that stands for a device
    default filled in (what the engine and a benchmark's record then both read)."""
    cuda, one_rank = device.type == "cuda", config.tensor_parallel_size == 1
    if config.reasoning_parser not in (None, *REASONING_PARSERS):
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got "
                         f"{config.reasoning_parser!r}")
    if config.scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got "
                         f"{config.scheduling_policy!r}")
    eager = not cuda if config.enforce_eager is None else config.enforce_eager

    def default(value: object, fallback: object) -> object:
        return fallback if value is None else value

    return replace(
        config,
        block_size=default(config.block_size, default_block_size(device)),
        max_num_batched_tokens=default(config.max_num_batched_tokens,
                                       default_max_num_batched_tokens(device)),
        piecewise_graphs=default(config.piecewise_graphs, cuda and not eager and one_rank),
        async_scheduling=default(config.async_scheduling, cuda and one_rank))


def sampling_defaults(config: EngineConfig, model_fields: generation_config.Fields
                      ) -> SamplingDefaults:
    """The defaults requests fall back to (models/generation_config.py's rule), each checked
    as a request's field would be: ValueError for one the engine could not honour."""
    found = generation_config.resolve(config.generation_config, model_fields,
                                      config.override_generation_config)
    try:
        SamplingParams(**found.fields).validate()
    except InvalidRequest as e:
        raise ValueError(f"generation config: {e}") from None
    if found.fields:  # vLLM warns too: these are not OpenAI's defaults
        log.warning("sampling defaults from the generation config: %s "
                    "(--generation-config vllm: none)", found.fields)
    return found


def resolve_max_model_len(requested: int | None, context: int, pool_tokens: int) -> int:
    """The model's context, capped by what the KV pool holds. A requested length past that
    is lowered, and the log says so (vLLM refuses it; here the pool is sized by memory, and
    a pool that holds less is a cap, not an error)."""
    limit = min(context, pool_tokens)
    if requested is not None and requested > limit:
        why = "the model's context" if context <= pool_tokens else \
            f"what the KV pool holds ({pool_tokens} tokens)"
        log.warning("max_model_len %d lowered to %d: %s", requested, limit, why)
    return limit if requested is None else min(requested, limit)
