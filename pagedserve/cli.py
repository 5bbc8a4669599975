"""`pagedserve` command line: generate (offline), serve (HTTP), bench."""

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable

import pagedserve
from pagedserve.bench.cli import add_bench_parser
from pagedserve.engine import LLM, InvalidRequest, SamplingParams, distributed
from pagedserve.engine.args import add_engine_args, engine_config
from pagedserve.engine.outputs import RequestOutput
from pagedserve.models.generation_config import SamplingDefaults
from pagedserve.models.loader import ModelLoadError
from pagedserve.models.tokenizer import check_text
from pagedserve.server.cli import add_serve_parser


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline for one or more prompts")
    add_engine_args(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    # Unset, a sampling flag takes the model's generation config, else GENERATE_DEFAULTS.
    p.add_argument("--max-tokens", type=int, help="default: the model's max_new_tokens, or 64")
    p.add_argument("--temperature", type=float,
                   help="default: the model's generation config, or 0 (greedy)")
    p.add_argument("--top-p", type=float, help="default: the model's, or 1 (off)")
    p.add_argument("--top-k", type=int, help="default: the model's, or 0 (off)")
    p.add_argument("--min-p", type=float, help="default: the model's, or 0 (off)")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, then stats")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.set_defaults(func=cmd_generate)


GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 0.0}
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p")


def _params(args: argparse.Namespace, defaults: SamplingDefaults) -> SamplingParams:
    """The flags given, then the model's generation config, then GENERATE_DEFAULTS (as a
    request's fields over the config in vLLM's server); max_tokens within its cap."""
    given = {k: v for k in SAMPLING_FLAGS if (v := getattr(args, k)) is not None}
    fields = {**GENERATE_DEFAULTS, **defaults.fields, **given}
    if defaults.max_tokens_cap is not None:
        fields["max_tokens"] = min(fields["max_tokens"], defaults.max_tokens_cap)
    params = SamplingParams(n=args.n, seed=args.seed, ignore_eos=args.ignore_eos, **fields)
    params.validate()
    return params


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # in-function: only generate needs it (start-up time)

    if sys.stdout is None:  # (started with stdout closed: `>&-`)
        raise InvalidRequest("standard output is closed")
    _params(args, SamplingDefaults())  # the flags, checked before the model loads
    if "" in args.prompts:  # (whitespace is a prompt: it has tokens)
        raise InvalidRequest("a prompt must not be empty")
    for prompt in args.prompts:  # before the model loads (seconds): argv may not be UTF-8
        try:
            check_text(prompt)
        except ValueError as e:
            raise InvalidRequest(f"The prompt: {e}.") from None
    config = engine_config(args)
    with tqdm(total=1, desc="loading model", file=sys.stderr, disable=None) as bar:
        llm = LLM(**vars(config))
        bar.update()
    params = _params(args, llm.engine.sampling_defaults)
    prompts: list[str | list[int]] = list(args.prompts)
    if args.chat:
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in args.prompts]
    start = time.perf_counter()
    bar = functools.partial(tqdm, file=sys.stderr, disable=None)  # (a terminal's only)
    outputs = llm.generate(prompts, params, use_tqdm=bar)
    elapsed = time.perf_counter() - start
    try:
        for prompt, out in zip(args.prompts, outputs, strict=True):
            _print_output(prompt, out, args.json, args.chat)
        if args.json:
            stats = dict(llm.engine.stats(), elapsed_s=round(elapsed, 4))
            print(json.dumps({"stats": stats}))
        sys.stdout.flush()
    except OSError as e:  # the reader went away (`| head`), a full disk...
        if not isinstance(e, BrokenPipeError):  # (after `| head`, nothing more to say)
            print(f"pagedserve: error: writing the output failed: {e}", file=sys.stderr)
        # Python's own flush of stdout at exit would fail again, with a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def _print_output(prompt: str, out: RequestOutput, as_json: bool, chat: bool) -> None:
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
        print(f"{label}{o.text}" if chat else f"{label}{prompt}{o.text}")  # a reply, or more


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {pagedserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Expected failures (bad input, a missing model) end in one line on stderr."""
    try:
        return func(args)
    except (InvalidRequest, ModelLoadError, ValueError) as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None and distributed.launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:  # else each rank would run its own engine, or wait for good
            print(f"pagedserve: error: --tensor-parallel-size {tp}, but torchrun started "
                  f"{world} ranks: they must be equal", file=sys.stderr)
            return 2
        if int(os.environ["RANK"]) > 0:
            # torchrun starts every rank with the same command: rank 0 runs it, the others
            # serve rank 0's steps (it sends them its engine config).
            return distributed.worker_main()
    return run(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
