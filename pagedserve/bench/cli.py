"""`pagedserve bench serve|throughput`: the two benchmark sub-commands and their flags."""

from __future__ import annotations

import argparse

from pagedserve.bench.serve_client import add_serve_bench_args, check_json_path, cmd_serve_bench
from pagedserve.bench.throughput import add_throughput_args, cmd_throughput
from pagedserve.engine.args import add_engine_args


def _checked_throughput(args: argparse.Namespace) -> int:
    """Flags checked before the model loads, not minutes into the run."""
    if args.hf_max_prompts < 0:
        raise ValueError("--hf-max-prompts must not be negative (0: all rows)")
    if args.prefix_len is not None and args.prefix_len < 0:
        raise ValueError("--prefix-len must not be negative")
    check_json_path(args.json)
    return cmd_throughput(args)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark a server (serve) or the engine (throughput)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser(
        "serve", help="load-test an OpenAI-compatible server with streamed requests")
    add_serve_bench_args(serve)
    serve.set_defaults(func=cmd_serve_bench)
    thr = kinds.add_parser(
        "throughput", help="offline workload through the engine, optional HF baseline, roofline")
    add_engine_args(thr)
    add_throughput_args(thr)
    thr.set_defaults(func=_checked_throughput)
