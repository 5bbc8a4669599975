"""`pagedserve bench serve|throughput`: the two benchmark sub-commands and their flags."""

from __future__ import annotations

import argparse

from pagedserve.bench.serve_client import add_serve_bench_args, cmd_serve_bench
from pagedserve.bench.throughput import add_throughput_args, cmd_throughput
from pagedserve.engine.args import add_engine_args


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
    thr.set_defaults(func=cmd_throughput)
