"""`pagedserve` command line: generate (offline), serve (HTTP), bench."""

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from pagedserve.bench.cli import add_bench_parser
from pagedserve.engine import LLM, InvalidRequest, SamplingParams, distributed
from pagedserve.engine.args import add_engine_args, engine_config
from pagedserve.engine.outputs import RequestOutput
from pagedserve.models.loader import ModelLoadError
from pagedserve.models.tokenizer import check_text
from pagedserve.server.cli import add_serve_parser


def _generate_parser(sub: argparse._SubParsersAction) -> None:
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
    from tqdm import tqdm  # in-function: only generate needs it (start-up time)

    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos)
    params.validate()
    if any(not p.strip() for p in args.prompts):
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
    prompts: list[str | list[int]] = list(args.prompts)
    if args.chat:
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in args.prompts]
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc="generating", file=sys.stderr, disable=None) as bar:
        outputs = llm.generate(prompts, params, on_step=lambda done: bar.update(done - bar.n))
    elapsed = time.perf_counter() - start
    try:
        for prompt, out in zip(args.prompts, outputs, strict=True):
            _print_output(prompt, out, args.json)
        if args.json:
            stats = dict(llm.engine.stats(), elapsed_s=round(elapsed, 4))
            print(json.dumps({"stats": stats}))
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        # Python's own flush of stdout at exit would fail again, with a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
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
