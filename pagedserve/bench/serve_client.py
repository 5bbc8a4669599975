"""`pagedserve bench serve`: load-test an OpenAI-compatible server (pagedserve, llama.cpp's
llama-server, vLLM) with streamed requests.

Timing, per request, from the moment it is sent (after waiting for its arrival time and a
concurrency slot): TTFT = first chunk with content text; ITL = gaps between content
chunks; E2E = until the stream ends; TPOT = (E2E - TTFT) / (output_tokens - 1), for
requests with more than one output token. Token counts come from the final ``usage``
chunk (stream_options.include_usage); a server that sends none is counted by content
chunks and flagged in ``usage_missing``. A request without a content chunk, or past
``--timeout``, fails (serve_stream.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import numpy as np

from pagedserve.bench import report
from pagedserve.bench.machine import machine_facts
from pagedserve.bench.serve_runner import (
    Shard,
    WorkerFailed,
    base_url,
    run_local,
    run_processes,
)
from pagedserve.bench.serve_stream import PATHS, RequestResult
from pagedserve.bench.stats import summarize
from pagedserve.bench.workloads import serve_dataset


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s, from the start) of n requests: all at 0 for rate inf; otherwise gaps
    drawn from a gamma distribution with shape=burstiness and mean 1/rate (shape 1 is a
    Poisson process; below 1 burstier, above 1 more regular, inf evenly spaced: the
    gamma's limit). The first request goes at 0."""
    if not rate > 0 or not burstiness > 0:  # nan too
        raise ValueError("--request-rate and --burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:n]


def first_model(url: str, headers: dict[str, str]) -> str:
    import httpx

    try:
        resp = httpx.get(f"{base_url(url)}/v1/models", headers=headers, timeout=30.0)
        resp.raise_for_status()
    except httpx.HTTPError as e:
        raise ValueError(f"{url}: cannot list models ({e}); pass --model") from e
    models = resp.json().get("data") or []
    if not models:
        raise ValueError("GET /v1/models lists no model; pass --model")
    return models[0]["id"]


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The requests sent by ``--num-workers`` client processes, each with its share of the
    concurrency (serve_runner.py): one Python process spends ~30-60 us of CPU a streamed
    chunk, so at tens of thousands of tokens a second it, not the server, would set the
    pace."""
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = args.model or first_model(args.base_url, headers)
    requests = serve_dataset(
        args.dataset, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
        args.prefix_len, args.seed, args.vocab_size, as_text=args.endpoint == "chat")
    if len(requests) < args.num_prompts:
        print(f"bench serve: {args.dataset} has {len(requests)} prompts, fewer than "
              f"--num-prompts {args.num_prompts}: sending {len(requests)}", file=sys.stderr)
    limit = min(args.max_concurrency or len(requests), len(requests))
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    workers = max(1, min(args.num_workers, limit))
    shards = [Shard(requests, offsets, limit // workers + (i < limit % workers))
              for i in range(workers)]
    if workers == 1:
        runs = [run_local(args, model, shards[0], headers)]
    else:
        runs = run_processes(args, model, shards, headers)
    # Back in the order sent, whichever process sent each.
    by_index = {i: result for run in runs for i, result in run.results}
    results = [by_index[i] for i in range(len(requests))]
    duration = max(run.end for run in runs) - min(run.start for run in runs)
    return summarize_results(results, duration, args, model, sum(run.cpu for run in runs))


def summarize_results(results: list[RequestResult], duration: float,
                      args: argparse.Namespace, model: str,
                      client_cpu: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    errors: list[str] = []
    for r in results:
        if r.error and r.error not in errors and len(errors) < 5:
            errors.append(r.error)
    rate = args.request_rate
    return {
        "bench": "serve",
        "machine": machine_facts(),
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "dataset": args.dataset,
        "num_prompts": len(results),  # those sent: a JSONL dataset may hold fewer
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "prefix_len": args.prefix_len if args.dataset == "shared-prefix" else None,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "num_workers": args.num_workers,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "usage_missing": sum(r.usage_missing for r in ok),
        "duration_s": duration,
        # The client's own CPU over the timed part: near duration_s, the client (one Python
        # process) may be what caps the figures, not the server.
        "client_cpu_s": client_cpu,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None], 1e3),
        "tpot_ms": summarize([t for r in ok if (t := r.tpot) is not None], 1e3),
        "itl_ms": summarize([gap for r in ok for gap in r.itl], 1e3),
        "e2el_ms": summarize([r.e2e for r in ok], 1e3),
    }


def check_json_path(path: str | None) -> None:
    """A ValueError now, not after the run, where ``--json`` cannot be written."""
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        existed = os.path.exists(path)
        with open(path, "a", encoding="utf-8"):  # appends nothing: the file stays as it is
            pass
        if not existed:
            os.remove(path)
    except OSError as e:
        raise ValueError(f"--json {path}: {e.strerror or e}") from None


def check_args(args: argparse.Namespace) -> None:
    """The flags that no dataset or server check would name (nan passes ``<= 0``)."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.num_workers < 1:
        raise ValueError("--num-workers must be at least 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be positive (inf: all at once)")
    if not args.burstiness > 0:
        raise ValueError("--burstiness must be positive (inf: evenly spaced arrivals)")
    if not args.timeout > 0:
        raise ValueError("--timeout must be positive seconds (inf: no limit)")
    if args.vocab_size < 1:
        raise ValueError("--vocab-size must be at least 1")
    if args.prefix_len < 0:
        raise ValueError("--prefix-len must not be negative")
    check_json_path(args.json)


def cmd_serve_bench(args: argparse.Namespace) -> int:
    check_args(args)
    try:
        result = run_benchmark(args)
    except WorkerFailed as e:  # one line, as the CLI's other errors; no result to write
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 1
    print(report.format_serve(result))
    if args.json:
        report.write_json(args.json, result)
    return 0 if result["completed"] else 1


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--endpoint", choices=list(PATHS), default="completions",
                   help="completions sends token-id prompts; chat sends texts of random words")
    p.add_argument("--dataset", default="random", metavar="random|shared-prefix|PATH.jsonl",
                   help='JSONL lines: {"prompt": "text" or [ids], "output_len": N}')
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256,
                   help="prompt length (shared-prefix: the unique suffix's length)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: prompt lengths uniform in [L*(1-R), L*(1+R)]")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: prefix length")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (Poisson, or gamma with --burstiness); inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps (1: Poisson; inf: evenly spaced)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="random token ids come from [100, V-100)")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may take as a whole, from sending it to its "
                        "stream's end (past it, the request fails); inf: no limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=1,
                   help="client processes, sharing the requests and the concurrency "
                        "(a fast server can outrun one Python client)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON")
