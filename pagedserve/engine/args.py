"""The engine's command-line arguments, next to the EngineConfig they fill (vLLM's
EngineArgs pattern). Every sub-command that builds an engine (generate, serve, bench
throughput) adds these flags and turns the parsed namespace into an EngineConfig here."""

import argparse
import json
import math
import os

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.models import generation_config
from pagedserve.models.loader import read_model_config
from pagedserve.models.parallel import TensorParallel
from pagedserve.models.reasoning import PARSERS as REASONING_PARSERS
from pagedserve.scheduler import InvalidRequest

# The dtype names taken, vLLM's aliases among them (auto aside).
DTYPE_ALIASES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                 "half": "float16", "float": "float32"}
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
# --distributed-timeout's range: a millisecond (gloo's unit) to ten years (the ranks' idle
# wait), which the timedelta and the backends' millisecond counts hold.
DISTRIBUTED_TIMEOUT_RANGE_S = (0.001, 3650 * 86400.0)


def human_int(value: str) -> int:
    """A count as vLLM reads it: 32768, 32k (32,000), 32K (32,768) or 1.5m."""
    number, unit = (value[:-1], _SUFFIXES[value[-1]]) if value[-1:] in _SUFFIXES else (value, 1)
    try:
        scaled = float(number) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {value!r}") from None
    if not scaled.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {value!r}")
    return int(scaled)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", *DTYPE_ALIASES],
                   help="auto: bfloat16 where the CPU/GPU has fast bf16 matmul, else float32 "
                        "(vLLM's half and float: float16, float32)")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="tokens per KV block (default: 32 on a CPU, 16 on CUDA)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: from --kv-cache-memory-gib)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help=f"KV pool size in GiB (default: {d.kv_cache_memory_gib})")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="CUDA: the share of the GPU's memory this engine may hold, weights "
                        "and activations included; the KV pool gets the rest of it (vLLM's "
                        "flag, e.g. 0.9). Unused on a CPU")
    p.add_argument("--max-num-batched-tokens", type=human_int, default=d.max_num_batched_tokens,
                   help="tokens a step may carry, prefill chunks and decodes together "
                        "(default: 1024 on a CPU, 8192 on CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-model-len", type=human_int, default=None,
                   help="the longest prompt plus output, in tokens (vLLM's forms too: 32k = "
                        "32,000, 32K = 32,768)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads for PyTorch (default: PyTorch's choice)")
    p.add_argument("--native-kernels", action=argparse.BooleanOptionalAction,
                   default=d.native_kernels,
                   help="CPU: C++ kernels, compiled on first use (off: PyTorch references)")
    p.add_argument("--triton-attention", default=d.triton_attention, choices=["basic", "flash"],
                   help="CUDA: flash (tensor cores, split-KV, fused RMSNorm/RoPE/SwiGLU) or "
                        "basic (the first kernels, a baseline)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction,
                   default=d.enforce_eager,
                   help="on: every step runs eagerly; off: decode steps replay CUDA graphs "
                        "(on CPU: the same padded path, uncaptured); default: graphs on CUDA "
                        "(not under tensor parallelism), eager on CPU")
    p.add_argument("--piecewise-graphs", action=argparse.BooleanOptionalAction,
                   default=d.piecewise_graphs,
                   help="where graphs run, steps with prefill chunks replay them too, "
                        "piecewise (all but attention, per padded token count); "
                        "default: on CUDA, off on CPU")
    p.add_argument("--full-graphs", action=argparse.BooleanOptionalAction,
                   default=d.full_graphs,
                   help="where piecewise graphs run, each such step replays one whole graph "
                        "instead, attention included (the flash kernels' flat grid); off "
                        "until verified on a GPU")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=d.async_scheduling,
                   help="schedule and launch each step before the previous step's tokens "
                        "are read back, which overlap it (one rank; a GPU gains, a CPU "
                        "does not); default: on CUDA, off on CPU")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"),
                   default=d.scheduling_policy,
                   help="fcfs: first come, first served; priority: requests with lower "
                        "'priority' values are admitted first and preempted last (vLLM's)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=d.reasoning_parser,
                   help="a thinking model's <think>...</think>: the chat answer's 'reasoning', "
                        "apart from its content, and a structured output after it (vLLM's)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   metavar="N", help="split the model over N ranks: N-1 worker processes "
                   "spawned here, or the ranks torchrun started (see README, Scaling out)")
    p.add_argument("--stream-interval", type=int, default=d.stream_interval, metavar="N",
                   help="a streamed request's chunk waits for N new tokens (the first and "
                        "the last go at once): fewer, larger chunks, less host time a token")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="a Jinja chat template, or a file holding one, in place of the "
                        "model's own (vLLM's flag)")
    p.add_argument("--generation-config", default=d.generation_config, metavar="auto|vllm|DIR",
                   help="sampling defaults for the fields a request leaves out: auto, the "
                        "model's generation_config.json (a GGUF's general.sampling keys); "
                        "vllm, none; or a directory holding a generation_config.json "
                        "(vLLM's flag)")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="defaults on top of those, in generation_config.json's names, e.g. "
                        "'{\"temperature\": 0.5}'; a max_new_tokens here caps every request")
    p.add_argument("--distributed-timeout", type=float, default=d.distributed_timeout_s,
                   metavar="S", help="tensor parallelism: a step whose collectives, or a "
                   "start-up message between ranks, take longer than S seconds (a rank died "
                   "or hangs) kills the engine")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed engine flags; InvalidRequest for a count below 1."""
    for name in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs",
                 "max_model_len", "tensor_parallel_size", "stream_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be at least 1")
    low, high = DISTRIBUTED_TIMEOUT_RANGE_S
    if not low <= args.distributed_timeout <= high:  # nan and inf too
        raise InvalidRequest(f"--distributed-timeout must be a number of seconds from {low:g} "
                             f"to {high:.0f} (ten years)")
    if args.num_threads is not None and args.num_threads < 0:
        raise InvalidRequest("--num-threads must be at least 0 (0: PyTorch's choice)")
    if args.kv_cache_memory_gib is not None and not 0 < args.kv_cache_memory_gib < math.inf:
        raise InvalidRequest("--kv-cache-memory-gib must be a positive number")
    utilization = args.gpu_memory_utilization
    if utilization is not None and not 0 < utilization <= 1:  # nan too
        raise InvalidRequest("--gpu-memory-utilization must be a fraction above 0, at most 1")
    sizes = [flag for flag, value in (("--num-kv-blocks", args.num_kv_blocks),
                                      ("--kv-cache-memory-gib", args.kv_cache_memory_gib),
                                      ("--gpu-memory-utilization", utilization))
             if value is not None]
    if len(sizes) > 1:
        raise InvalidRequest(f"{' and '.join(sizes)}: each sizes the KV pool; give one")
    if args.model is not None:  # (vllm serve ~/model works where no shell expands it)
        args.model = os.path.expanduser(args.model)
    if args.model is not None and not os.path.exists(args.model):  # before a server starts
        raise InvalidRequest(f"--model {args.model}: no such file or directory")
    check_device(args.device)
    if args.tensor_parallel_size > 1:  # a split that cannot work, before a server starts
        TensorParallel(0, args.tensor_parallel_size).check(read_model_config(args.model))
    chat_template = args.chat_template and _chat_template(args.chat_template)
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(
            args.generation_config):
        raise InvalidRequest(f"--generation-config {args.generation_config}: choose auto, "
                             "vllm or a directory")
    override = args.override_generation_config and _json_object(
        "--override-generation-config", args.override_generation_config)
    try:  # unknown keys and wrong types, before a server starts
        generation_config.resolve("vllm", {}, override)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    return EngineConfig(
        model=args.model, dtype=DTYPE_ALIASES.get(args.dtype, args.dtype),
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gib=args.kv_cache_memory_gib or EngineConfig.kv_cache_memory_gib,
        gpu_memory_utilization=utilization,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        device=args.device, num_threads=args.num_threads,
        native_kernels=args.native_kernels, triton_attention=args.triton_attention,
        enforce_eager=args.enforce_eager, piecewise_graphs=args.piecewise_graphs,
        full_graphs=args.full_graphs,
        async_scheduling=args.async_scheduling, scheduling_policy=args.scheduling_policy,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_timeout_s=args.distributed_timeout, stream_interval=args.stream_interval,
        chat_template=chat_template, reasoning_parser=args.reasoning_parser,
        generation_config=args.generation_config,
        override_generation_config=override or None,
    )


def _chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself. As vLLM reads it, a value with
    none of Jinja's braces and no line break is a path (a mistyped one is an error, not the
    template of every prompt)."""
    if not os.path.isfile(value) and any(c in value for c in "{}\n"):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InvalidRequest(f"--chat-template {value}: {e.strerror or e}") from None


def _json_object(flag: str, value: str) -> dict:
    try:
        found = json.loads(value)
    except ValueError as e:
        raise InvalidRequest(f"{flag}: not JSON ({e})") from None
    if not isinstance(found, dict):
        raise InvalidRequest(f"{flag}: a JSON object is needed, not {value!r}")
    return found


def check_device(name: str) -> None:
    """InvalidRequest unless ``name`` is auto, cpu, or a CUDA device that is here."""
    if name in ("auto", "cpu"):
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type != "cuda":
        raise InvalidRequest(f"--device {name!r}: choose auto, cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (device.index or 0) >= count:
        raise InvalidRequest(f"--device {name}: this machine has {count} CUDA device(s)")
