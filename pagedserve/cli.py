"""`pagedserve` command line: generate (offline), serve (HTTP), bench."""

import argparse
import json
import sys
import time
from collections.abc import Callable

from pagedserve.engine import LLM, EngineConfig, InvalidRequest, SamplingParams
from pagedserve.engine.outputs import RequestOutput


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 where the CPU/GPU has fast bf16 matmul, else float32")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: from --kv-cache-memory-gib)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=d.kv_cache_memory_gib)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads for PyTorch (default: PyTorch's choice)")
    p.add_argument("--native-kernels", action=argparse.BooleanOptionalAction,
                   default=d.native_kernels,
                   help="CPU: C++ kernels, compiled on first use (off: PyTorch references)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    for name in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs",
                 "max_model_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be at least 1")
    return EngineConfig(
        model=args.model, dtype=args.dtype, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        device=args.device, num_threads=args.num_threads,
        native_kernels=args.native_kernels,
    )


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline for one or more prompts")
    add_engine_args(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, then stats")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos)
    params.validate()
    config = engine_config(args)
    if any(not p.strip() for p in args.prompts):
        raise InvalidRequest("a prompt must not be empty")
    with tqdm(total=1, desc="loading model", file=sys.stderr, disable=None) as bar:
        llm = LLM(**vars(config))
        bar.update()
    prompts: list[str | list[int]] = list(args.prompts)
    if args.chat:
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in args.prompts]
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc="generating", file=sys.stderr, disable=None) as bar:
        outputs = llm.generate(prompts, params, on_step=lambda done: bar.update(done - bar.n))
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompts, outputs, strict=True):
        _print_output(prompt, out, args.json)
    if args.json:
        stats = dict(llm.engine.stats(), elapsed_s=round(elapsed, 4))
        print(json.dumps({"stats": stats}))
    return 0


def _print_output(prompt: str, out: RequestOutput, as_json: bool) -> None:
    if as_json:
        print(json.dumps({
            "prompt": prompt,
            "prompt_token_ids": out.prompt_token_ids,
            "outputs": [{"text": o.text, "token_ids": o.token_ids,
                         "finish_reason": o.finish_reason} for o in out.outputs],
        }))
        return
    for o in out.outputs:
        label = f"[{o.index}] " if len(out.outputs) > 1 else ""
        print(f"{label}{prompt}{o.text}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    from pagedserve.server.cli import add_serve_parser

    add_serve_parser(sub)
    from pagedserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Expected failures (bad input, a missing model) end in one line on stderr."""
    from pagedserve.models.loader import ModelLoadError

    try:
        return func(args)
    except (InvalidRequest, ModelLoadError, ValueError) as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
