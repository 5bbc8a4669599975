"""`pagedserve bench serve|throughput`: argument parsing only; the work is imported lazily."""

from __future__ import annotations

import argparse


def _serve(args: argparse.Namespace) -> int:
    from pagedserve.bench.serve_client import cmd_serve_bench

    return cmd_serve_bench(args)


def _throughput(args: argparse.Namespace) -> int:
    from pagedserve.bench.throughput import cmd_throughput

    return cmd_throughput(args)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from pagedserve.bench.serve_client import add_serve_bench_args
    from pagedserve.bench.throughput import add_throughput_args
    from pagedserve.cli import add_engine_args

    bench = sub.add_parser("bench", help="benchmark a server (serve) or the engine (throughput)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser(
        "serve", help="load-test an OpenAI-compatible server with streamed requests")
    add_serve_bench_args(serve)
    serve.set_defaults(func=_serve)
    thr = kinds.add_parser(
        "throughput", help="offline workload through the engine, optional HF baseline, roofline")
    add_engine_args(thr)
    add_throughput_args(thr)
    thr.set_defaults(func=_throughput)
