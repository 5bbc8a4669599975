"""`pagedserve bench serve`: load-test an OpenAI-compatible server (pagedserve, llama.cpp's
llama-server, vLLM) with streamed requests.

Timing, per request, from the moment it is sent (after waiting for its arrival time and a
concurrency slot): TTFT = first chunk with content text; ITL = gaps between content
chunks; E2E = until the stream ends; TPOT = (E2E - TTFT) / (output_tokens - 1), for
requests with more than one output token. Token counts come from the final ``usage``
chunk (stream_options.include_usage); a server that sends none is counted by content
chunks and flagged in ``usage_missing``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedserve.bench import report
from pagedserve.bench.machine import machine_facts
from pagedserve.bench.stats import summarize
from pagedserve.bench.workloads import BenchRequest, serve_dataset

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    ok: bool
    e2e: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_missing: bool = False
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s, from the start) of n requests: all at 0 for rate inf; otherwise gaps
    drawn from a gamma distribution with shape=burstiness and mean 1/rate (shape 1 is a
    Poisson process; below 1 burstier, above 1 more regular). The first request goes at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:n]


def request_body(req: BenchRequest, endpoint: str, model: str, temperature: float,
                 ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": req.output_len, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _content(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choices[0].get("text") or ""


async def send(client: Any, path: str, body: dict[str, Any], endpoint: str) -> RequestResult:
    import httpx

    start = last = time.perf_counter()
    result = RequestResult(ok=False)
    usage: dict[str, Any] | None = None
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    # Not break: read on to the body's end (nothing but the chunked
                    # encoding's last chunk), or httpx closes the connection rather than
                    # keep it alive, and every request pays a new one (the openai SDK
                    # reads on too).
                    continue
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return result
                usage = chunk.get("usage") or usage
                if _content(chunk, endpoint):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    result.e2e = time.perf_counter() - start
    result.ok = True
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_tokens = usage.get("prompt_tokens")
    else:
        result.output_tokens, result.usage_missing = chunks, True
    return result


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1")


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


@dataclass
class Shard:
    """One client process's part of the run: its requests, their send times (s from the
    shared start) and its share of the concurrency."""

    requests: list[BenchRequest]
    offsets: list[float]
    limit: int


@dataclass
class ShardRun:
    results: list[RequestResult]
    # perf_counter at the run's start and when its last request ended (CLOCK_MONOTONIC: one
    # clock for every client process)
    start: float
    end: float
    cpu: float  # the process's CPU seconds over its timed part


async def run_shard(args: argparse.Namespace, model: str, shard: Shard, headers: dict[str, str],
                    start: Callable[[], float], progress: bool) -> ShardRun:
    """Sends a shard's requests, at most ``shard.limit`` at a time, each over a connection
    kept alive from one request to the next; ``start`` is called once the client is ready
    and returns the run's start (perf_counter, waiting for it where it is shared).

    An httpx client per request in flight, each with one connection, made as the
    concurrency first reaches it: one client's pool checks every idle connection (syscalls)
    for each request it sends, which with 64 kept alive cost ~4 ms of the client's CPU a
    request on a 2-vCPU machine, against ~0.7 ms this way."""
    import httpx
    from tqdm import tqdm

    slots = asyncio.Semaphore(shard.limit)
    idle: list[Any] = []  # clients between requests, the one used last at the end
    made: list[Any] = []
    ssl_context = httpx.create_ssl_context()  # shared: each client would build one (~10-20 ms)

    def take_client() -> Any:
        if idle:
            return idle.pop()
        made.append(httpx.AsyncClient(
            base_url=base_url(args.base_url), headers=headers, verify=ssl_context,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            timeout=httpx.Timeout(args.timeout, connect=30.0)))
        return made[-1]

    path = PATHS[args.endpoint]
    bar = tqdm(total=len(shard.requests), desc="requests", file=sys.stderr,
               disable=None if progress else True)

    async def one(req: BenchRequest, offset: float) -> RequestResult:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots:
            body = request_body(req, args.endpoint, model, args.temperature, args.ignore_eos)
            client = take_client()
            try:
                result = await send(client, path, body, args.endpoint)
            finally:
                idle.append(client)
        bar.update()
        return result

    try:
        # A collection of the client's whole heap (~100 ms) would count as the server's
        # latency: what exists now is kept to the end anyway.
        gc.collect()
        gc.freeze()
        t0 = start()
        cpu0 = time.process_time()
        results = await asyncio.gather(*(one(r, o) for r, o in zip(
            shard.requests, shard.offsets, strict=True)))
        end, cpu = time.perf_counter(), time.process_time() - cpu0
    finally:
        bar.close()
        for client in made:
            await client.aclose()
    return ShardRun(results, t0, end, cpu)


def _shard_process(args: argparse.Namespace, model: str, shard: Shard, headers: dict[str, str],
                   barrier: Any, start_at: Any, out: Any) -> None:
    def start() -> float:
        barrier.wait()  # every client process ready; the parent then sets the start
        barrier.wait()
        t0 = start_at.value
        time.sleep(max(0.0, t0 - time.perf_counter()))
        return t0

    try:
        run = asyncio.run(run_shard(args, model, shard, headers, start, progress=False))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        barrier.abort()  # the parent and the other client processes stop waiting
        out.put(RuntimeError(f"a client process failed: {type(e).__name__}: {e}"))
        return
    out.put(run)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The requests dealt round-robin to ``--num-workers`` client processes, each with its
    share of the concurrency: one Python process spends ~30-60 us of CPU a streamed chunk,
    so at tens of thousands of tokens a second it, not the server, would set the pace."""
    limit = args.max_concurrency or args.num_prompts
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = args.model or first_model(args.base_url, headers)
    requests = serve_dataset(
        args.dataset, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
        args.prefix_len, args.seed, args.vocab_size, as_text=args.endpoint == "chat")
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    workers = max(1, min(args.num_workers, limit, len(requests)))
    shards = [Shard(requests[i::workers], offsets[i::workers],
                    limit // workers + (i < limit % workers)) for i in range(workers)]
    if workers == 1:
        runs = [asyncio.run(run_shard(args, model, shards[0], headers, time.perf_counter,
                                      progress=True))]
    else:
        context = multiprocessing.get_context("spawn")
        barrier, start_at, out = context.Barrier(workers + 1), context.Value("d"), context.Queue()
        procs = [context.Process(target=_shard_process, daemon=True,
                                 args=(args, model, shard, headers, barrier, start_at, out))
                 for shard in shards]
        for proc in procs:
            proc.start()
        with contextlib.suppress(threading.BrokenBarrierError):  # a client failed: see out
            barrier.wait(timeout=300)
            start_at.value = time.perf_counter() + 0.01
            barrier.wait(timeout=300)
        runs = [out.get() for _ in procs]
        for proc in procs:
            proc.join()
        for run in runs:
            if isinstance(run, Exception):
                raise run
    # Back in the order sent (shard i holds requests i, i + workers, ...).
    results = [runs[i % workers].results[i // workers] for i in range(len(requests))]
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
        "num_prompts": args.num_prompts,
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


def cmd_serve_bench(args: argparse.Namespace) -> int:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    result = run_benchmark(args)
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
                   help="gamma shape of the arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="random token ids come from [100, V-100)")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=1,
                   help="client processes, the requests and the concurrency dealt among them "
                        "(a fast server can outrun one Python client)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON")
