"""The sending side of `bench serve`: in one process, or in ``--num-workers`` client
processes that share one request queue and one concurrency budget.

However many processes, request i is sent at its arrival time or, when all
``--max-concurrency`` slots are busy, as the next slot frees (vLLM's one semaphore): every
process has its share of the slots, and each slot, once free, claims the next request
index from a counter that the processes share, so no process sits idle while another has
a backlog.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import math
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.bench.serve_stream import PATHS, RequestResult, request_body, send_within
from pagedserve.bench.workloads import BenchRequest

READY_TIMEOUT_S = 300.0  # for every client process to start (imports, first connection)
POLL_S = 0.5  # how often the parent checks that its client processes are alive


class WorkerFailed(RuntimeError):
    """A client process failed or died: the run has no complete result."""


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1")


@dataclass
class Shard:
    """What one client process needs: every request and its send time (s from the shared
    start), and its share of the concurrency (the slots it runs)."""

    requests: list[BenchRequest]
    offsets: list[float]
    limit: int


@dataclass
class ShardRun:
    results: list[tuple[int, RequestResult]]  # (request index, its result)
    # perf_counter at the run's start and when its last request ended (CLOCK_MONOTONIC: one
    # clock for every client process)
    start: float
    end: float
    cpu: float  # the process's CPU seconds over its timed part


async def run_shard(args: argparse.Namespace, model: str, shard: Shard, headers: dict[str, str],
                    start: Callable[[], float], claim: Callable[[], int],
                    progress: bool) -> ShardRun:
    """Runs ``shard.limit`` slots, each sending the request that ``claim`` hands it (the
    next index, or one past the last when none is left) over a connection kept alive from
    one request to the next; ``start`` is called once the client is ready and returns the
    run's start (perf_counter, waiting for it where it is shared).

    An httpx client per slot, each with one connection, made as the slot is first used:
    one client's pool checks every idle connection (syscalls) for each request it sends,
    which with 64 kept alive cost ~4 ms of the client's CPU a request on a 2-vCPU machine,
    against ~0.7 ms this way."""
    import httpx
    from tqdm import tqdm

    made: list[Any] = []
    ssl_context = httpx.create_ssl_context()  # shared: each client would build one (~10-20 ms)
    path = PATHS[args.endpoint]
    # None in a client process: even a disabled bar makes a multiprocessing lock, which a
    # killed process leaves to the resource tracker (a warning after the error).
    bar = tqdm(total=len(shard.requests), desc="requests", file=sys.stderr,
               disable=None) if progress else None
    results: list[tuple[int, RequestResult]] = []
    limit_s = None if math.isinf(args.timeout) else args.timeout  # each request's, as a whole

    async def slot() -> None:
        client = None
        while (i := claim()) < len(shard.requests):
            delay = t0 + shard.offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if client is None:
                client = httpx.AsyncClient(
                    base_url=base_url(args.base_url), headers=headers, verify=ssl_context,
                    limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                    timeout=httpx.Timeout(limit_s, connect=30.0))
                made.append(client)
            body = request_body(shard.requests[i], args.endpoint, model, args.temperature,
                                args.ignore_eos)
            results.append((i, await send_within(client, path, body, args.endpoint,
                                                 limit_s)))
            if bar is not None:
                bar.update()

    try:
        # A collection of the client's whole heap (~100 ms) would count as the server's
        # latency: what exists now is kept to the end anyway.
        gc.collect()
        gc.freeze()
        t0 = start()
        cpu0 = time.process_time()
        await asyncio.gather(*(slot() for _ in range(shard.limit)))
        end, cpu = time.perf_counter(), time.process_time() - cpu0
    finally:
        if bar is not None:
            bar.close()
        for client in made:
            await client.aclose()
    return ShardRun(results, t0, end, cpu)


def run_local(args: argparse.Namespace, model: str, shard: Shard,
              headers: dict[str, str]) -> ShardRun:
    """The whole run in this process."""
    counter = itertools.count()
    return asyncio.run(run_shard(args, model, shard, headers, time.perf_counter,
                                 counter.__next__, progress=True))


def _shard_process(index: int, args: argparse.Namespace, model: str, shard: Shard,
                   headers: dict[str, str], counter: Any, start_at: Any, go: Any,
                   out: Any) -> None:
    parent = os.getppid()

    def start() -> float:
        out.put(("ready", index, None))
        while not go.wait(1.0):  # the parent sets the start once every process is ready
            if os.getppid() != parent:
                raise RuntimeError("the parent process is gone")
        t0 = start_at.value
        time.sleep(max(0.0, t0 - time.perf_counter()))
        return t0

    def claim() -> int:
        with counter.get_lock():
            counter.value += 1
            return counter.value - 1

    try:
        run = asyncio.run(run_shard(args, model, shard, headers, start, claim, progress=False))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        out.put(("error", index, f"{type(e).__name__}: {e}"))
        return
    out.put(("done", index, run))


def _died(index: int, proc: Any) -> str:
    code = proc.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited ({code})"
    return f"client process {index} (pid {proc.pid}) {how} before it reported its results"


def _collect(out: Any, procs: list[Any], kind: str, timeout: float | None) -> dict[int, Any]:
    """Every process's ``kind`` message, by process index; WorkerFailed as soon as one
    reports an error, dies without its message, or (``timeout``) is too slow."""
    got: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout

    def take(message: tuple[str, int, Any]) -> None:
        what, index, value = message
        if what == "error":
            raise WorkerFailed(f"client process {index} failed: {value}")
        if what == kind:
            got[index] = value

    while len(got) < len(procs):
        try:
            take(out.get(timeout=POLL_S))
            continue
        except queue.Empty:
            pass
        dead = [i for i, p in enumerate(procs) if i not in got and p.exitcode is not None]
        if dead:
            # A process flushes the queue before it exits: what it sent is readable now.
            while True:
                try:
                    take(out.get_nowait())
                except queue.Empty:
                    break
            for i in dead:
                if i not in got:
                    raise WorkerFailed(_died(i, procs[i]))
        if deadline is not None and time.monotonic() > deadline:
            raise WorkerFailed(f"client processes not ready after {timeout:g} s")
    return got


def run_processes(args: argparse.Namespace, model: str, shards: list[Shard],
                  headers: dict[str, str]) -> list[ShardRun]:
    """One spawned client process a shard, started together; WorkerFailed (and no client
    process left running) if any of them fails or dies."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    counter, start_at = context.Value("q", 0), context.Value("d", 0.0)
    go, out = context.Event(), context.Queue()
    procs = [context.Process(target=_shard_process, daemon=True, name=f"bench-client-{i}",
                             args=(i, args, model, shard, headers, counter, start_at, go, out))
             for i, shard in enumerate(shards)]
    try:
        for proc in procs:
            proc.start()
        _collect(out, procs, "ready", READY_TIMEOUT_S)
        start_at.value = time.perf_counter() + 0.01
        go.set()
        runs = _collect(out, procs, "done", None)
        return [runs[i] for i in range(len(procs))]
    finally:
        # A failure or Ctrl-C: no client process left sending to the server.
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            if proc.pid is not None:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
