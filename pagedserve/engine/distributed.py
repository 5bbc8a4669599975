"""Tensor parallelism over torch.distributed: starting the ranks, each step's broadcast, and
the loop the other ranks run.

Rank 0 holds the engine (scheduler, block manager, sampling); ranks 1..N-1 hold only their
shard of the weights and of the KV pool, at the same block ids, and run every forward that
rank 0 runs. Rank 0 either spawns them on this host, or they were started by ``torchrun``
(``env://``: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), so that they can live on other
hosts; then rank 0 runs the CLI command and the other ranks run ``worker_main``. Spawned
ranks are fresh interpreters given the same ``env://`` variables torchrun sets, so both ways
share one code path (torch.multiprocessing's spawn would re-import the parent's __main__,
which starts a script without a main guard all over again in every worker); they also mark
their arrival in rank 0's store, which rank 0 watches along with their exits.

Two process groups: ``control``, the default one (gloo, CPU), carries the start-up messages
and each step's fixed-size header; the other ranks wait on it for the next step without a
timeout, since an idle server sends nothing, but each start-up message is bounded by
``timeout_s`` (a rank that stalls while the engine starts fails the start, naming the rank).
``data`` carries each step's packed tensor, the all-reduces and the logits gather: gloo on
CPU, NCCL on CUDA, with ``timeout_s``, so a rank that dies or hangs fails the step instead of
hanging it (RankFailed, after which the engine is dead). The spawned ranks' processes:
engine/tp_workers.py."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.engine import tp_workers
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.device_setup import DTYPES
from pagedserve.engine.model_runner import (
    HEADER_LEN,
    STOP,
    ModelRunner,
    build_model,
    payload_sizes,
)
from pagedserve.engine.tp_workers import RankFailed, describe_exits
from pagedserve.kernels import kernels_for
from pagedserve.models.loader import load_model_files
from pagedserve.models.parallel import TensorParallel

log = logging.getLogger("pagedserve.distributed")

# An idle server broadcasts nothing: the other ranks wait for the next header this long.
IDLE_TIMEOUT = timedelta(days=3650)
# A rank's interpreter and torch import take seconds, more on a busy host.
START_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class WorkerSpec:
    """What the other ranks need of rank 0's engine config (sent once, at start)."""

    model: str | None
    dtype: str  # resolved: float32, bfloat16 or float16
    device: str  # cpu or cuda
    block_size: int
    native_kernels: bool
    triton_attention: str
    num_threads: int | None
    timeout_s: float

    @classmethod
    def of(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> WorkerSpec:
        """Rank 0's; on a CPU, ranks spawned here share its cores evenly."""
        threads = config.num_threads
        if threads is None and device.type == "cpu" and not launched_by_torchrun():
            threads = max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
            torch.set_num_threads(threads)
        return cls(model=config.model, dtype=str(dtype).removeprefix("torch."),
                   device=device.type, block_size=config.block_size,
                   native_kernels=config.native_kernels, triton_attention=config.triton_attention,
                   num_threads=threads, timeout_s=config.distributed_timeout_s)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class Group:
    """One rank's membership: its groups, device and (on rank 0) the processes it spawned."""

    def __init__(self, rank: int, size: int, device: torch.device, control: Any, data: Any,
                 step_timeout: timedelta, workers: list[subprocess.Popen] | None = None):
        self.rank, self.size, self.device = rank, size, device
        self.control, self.data = control, data
        self.step_timeout = step_timeout
        self.tp = TensorParallel(rank, size, data)
        self.workers = workers or []  # spawned worker processes (rank 0 without torchrun)
        self.lifeline: int | None = None  # the pipe's write end whose EOF ends the workers
        self.failed: str | None = None
        self.started = False  # the start-up barrier passed: the ranks take steps
        self.closed = False
        self._lock = threading.Lock()  # the exit watcher's thread against close()
        self._lost: str | None = None  # a spawned rank exited unasked
        self._on_failure: Callable[[str], None] | None = None

    # ---- start-up (control group; each message bounded by the step timeout) ---------------
    def share_ints(self, values: list[int] | None, count: int) -> list[int]:
        """Rank 0's ``values`` on every rank."""
        t = torch.tensor(values if self.rank == 0 else [0] * count, dtype=torch.int64)
        if self.rank == 0:
            for peer in range(1, self.size):
                self._exchange(dist.isend(t, peer, group=self.control), peer, "KV pool size")
        else:
            self._exchange(dist.irecv(t, 0, group=self.control), 0, "KV pool size")
        return t.tolist()

    def barrier(self) -> None:
        """Every rank has its weights and KV pool: each tells rank 0."""
        ready, what = torch.ones(1, dtype=torch.int64), "weights loaded"
        if self.rank == 0:
            for peer in range(1, self.size):
                self._exchange(dist.irecv(ready, peer, group=self.control), peer, what)
        else:
            self._exchange(dist.isend(ready, 0, group=self.control), 0, what)
        self.started = True

    def _exchange(self, work: Any, peer: int, what: str) -> None:
        _exchange(work, peer, what, self.step_timeout, self.workers)

    # ---- each step ----------------------------------------------------------------------
    def send(self, header: list[int], payload: torch.Tensor) -> torch.Tensor:
        """Rank 0: broadcast a step (the header, then the packed tensor on the data
        group's device); returns the payload on this rank's device."""
        if self.failed:
            raise RankFailed(self.failed)
        self._send_header(header)
        if self.device.type != "cpu":
            payload = payload.pin_memory().to(self.device, non_blocking=True)
        dist.broadcast(payload, src=0, group=self.data)
        return payload

    def _send_header(self, header: list[int]) -> None:
        # A gloo send completes only once the receiver has asked for it: a rank stuck before
        # its next receive would hold rank 0 for the control group's own, longer timeout.
        dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0, group=self.control,
                       async_op=True).wait(timeout=self.step_timeout)

    def receive(self) -> tuple[list[int], torch.Tensor] | None:
        """Ranks 1..N-1: the next step from rank 0, or None when it says stop."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        values = header.tolist()
        if values[0] == STOP:
            return None
        payload = torch.empty(sum(payload_sizes(values)), dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0, group=self.data)
        return values, payload

    @contextlib.contextmanager
    def fatal_errors(self) -> Iterator[None]:
        """Whatever fails inside leaves the ranks out of step: it becomes RankFailed."""
        try:
            yield
        except RankFailed:
            raise
        except Exception as e:
            self.failed = f"a tensor-parallel step failed: {e}{describe_exits(self.workers)}"
            raise RankFailed(self.failed) from e
        except BaseException:  # Ctrl-C mid-step: close() must not wait on the other ranks
            self.failed = "a tensor-parallel step was interrupted"
            raise

    # ---- a spawned rank's exit ----------------------------------------------------------
    def watch_workers(self) -> None:
        tp_workers.watch_exits(self.workers, self._worker_exited)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """``callback(message)``, from another thread, when a spawned rank exits unasked, idle
        or not (at once if one already has): no step need fail first."""
        with self._lock:
            self._on_failure, lost = callback, self._lost
        if lost:
            callback(lost)

    def _worker_exited(self) -> None:
        with self._lock:
            if self.closed or self._lost:  # stopped on purpose, or told already
                return
            self._lost = f"a tensor-parallel rank exited{describe_exits(self.workers)}"
            self.failed = self.failed or self._lost
            callback, lost = self._on_failure, self._lost
        if callback is not None:
            callback(lost)

    # ---- shutdown -----------------------------------------------------------------------
    def close(self) -> None:
        """Rank 0: tell the other ranks to stop and wait for the spawned ones; kill them after
        a failure (they may be stuck in a collective) or before start-up ended."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        orderly = self.started and not self.failed
        if orderly:
            with contextlib.suppress(Exception):
                self._send_header([STOP] + [0] * (HEADER_LEN - 1))
        tp_workers.stop(self.workers, 30 if orderly else 0)
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None
        with contextlib.suppress(Exception):  # so that a later engine can start its own
            dist.destroy_process_group()


def _exchange(work: Any, peer: int, what: str, timeout: timedelta,
              workers: list[subprocess.Popen]) -> None:
    """Wait for one start-up message to or from ``peer``: RankFailed naming it if the message
    takes longer than ``timeout`` (a stalled rank) or fails (a dead one)."""
    try:
        work.wait(timeout=timeout)
    except Exception as e:
        if "timed out" in str(e).lower():
            raise RankFailed(f"tensor-parallel start-up failed: rank {peer} did not answer "
                             f"within {timeout.total_seconds():g} s (stage: {what})") from None
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise RankFailed(f"tensor-parallel start-up failed: rank {peer} (stage: {what}): "
                         f"{first_line}{describe_exits(workers)}") from None


def _send_spec(spec: WorkerSpec, size: int, workers: list[subprocess.Popen]) -> None:
    """Rank 0: its spec to every other rank, as JSON (no pickle off a socket)."""
    data = torch.frombuffer(bytearray(json.dumps(dataclasses.asdict(spec)).encode()),
                            dtype=torch.uint8)
    timeout = timedelta(seconds=spec.timeout_s)
    for peer in range(1, size):
        for t in (torch.tensor([data.numel()]), data):
            _exchange(dist.isend(t, peer), peer, "engine settings", timeout, workers)


def _receive_spec() -> WorkerSpec:
    """Ranks 1..N-1: rank 0's spec (sent right after the rendezvous)."""
    length = torch.zeros(1, dtype=torch.int64)
    _exchange(dist.irecv(length, 0), 0, "engine settings", START_TIMEOUT, [])
    data = torch.empty(int(length), dtype=torch.uint8)
    _exchange(dist.irecv(data, 0), 0, "engine settings", START_TIMEOUT, [])
    return WorkerSpec(**json.loads(data.numpy().tobytes()))


def _join(rank: int, size: int, rendezvous: str | dist.Store, local_rank: int,
          spec: WorkerSpec | None = None, workers: list[subprocess.Popen] | None = None
          ) -> tuple[Group, WorkerSpec]:
    """Every rank: rendezvous (an init method, or the store of the ranks rank 0 spawned),
    make the groups (in the same order everywhere) and pass on rank 0's spec."""
    # Rank 0 bounds each wait of its own (its default timeout must not cut a step's header
    # short); the others wait for the next step for as long as rank 0 is idle.
    timeout = max(START_TIMEOUT, timedelta(seconds=spec.timeout_s)) if spec else IDLE_TIMEOUT
    found = {"init_method": rendezvous} if isinstance(rendezvous, str) else {"store": rendezvous}
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timeout, **found)
    if spec is not None:
        _send_spec(spec, size, workers or [])
    else:
        spec = _receive_spec()
    device = _device(spec.device, local_rank)
    step_timeout = timedelta(seconds=spec.timeout_s)
    data = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo",
                          timeout=step_timeout)
    return Group(rank, size, device, dist.group.WORLD, data, step_timeout, workers), spec


def start(size: int, spec: WorkerSpec) -> Group:
    """Rank 0: spawn ranks 1..size-1 on this host (or join those torchrun started), set up
    the groups and send them ``spec``."""
    if launched_by_torchrun():
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != size or rank != 0:
            raise ValueError(f"--tensor-parallel-size {size}, but torchrun started "
                             f"{world} ranks and this is rank {rank} (the engine runs on rank 0)")
        group = _join(0, size, "env://", int(os.environ.get("LOCAL_RANK", 0)), spec)[0]
        atexit.register(group.close)
        return group
    if spec.device == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    # The store on a port of the system's choice, whose joins are watched while the workers'
    # exits are too: one that dies before the rendezvous fails the start at once.
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=START_TIMEOUT)
    workers, lifeline = tp_workers.spawn(size, store.port)
    try:
        tp_workers.await_joins(store, workers, START_TIMEOUT)
        group = _join(0, size, store, 0, spec, workers)[0]
    except BaseException:
        tp_workers.stop(workers)
        os.close(lifeline)
        with contextlib.suppress(Exception):  # a later engine starts its own
            dist.destroy_process_group()
        raise
    group.lifeline = lifeline
    group.watch_workers()
    atexit.register(group.close)
    return group


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def die_with_parent(parent: int | None = None) -> None:
    """Linux: this process is killed when its parent dies (a worker or engine process left
    behind would hold its memory and its device); and exits now if its parent, pid
    ``parent``, died before that was set up (the start-up of a spawned process takes
    seconds). The parent is the *thread* that started this process: for processes started
    by a main thread (the tensor-parallel ranks have a lifeline instead)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        sys.exit(1)


def spawned_main() -> None:
    """A rank that rank 0 spawned on this host (SIGINT and SIGTERM already ignored)."""
    tp_workers.exit_with_parent()
    rank = int(os.environ["RANK"])
    sys.exit(_serve(rank, int(os.environ["WORLD_SIZE"]), rank, spawned=True))


def worker_main() -> int:
    """A rank >= 1 started by torchrun: serve rank 0's steps until it says stop. torchrun
    passes SIGINT and SIGTERM on to every rank: rank 0 drains its requests, then says stop."""
    tp_workers.ignore_stop_signals()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return _serve(rank, size, int(os.environ.get("LOCAL_RANK", rank)), spawned=False)


def _serve(rank: int, size: int, local_rank: int, spawned: bool) -> int:
    """Load this rank's shard, allocate its KV pool at rank 0's size, then run each step
    rank 0 broadcasts. 0 when rank 0 said stop; 1 (and a log line) on any failure."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s: rank {rank}: %(message)s")
    try:
        rendezvous: str | dist.Store = "env://"
        if spawned:  # rank 0 watches for this key (and for this process's exit)
            rendezvous = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       size, is_master=False, timeout=START_TIMEOUT)
            rendezvous.set(tp_workers.joined_key(rank), "1")
        group, spec = _join(rank, size, rendezvous, local_rank)
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        dtype, device = DTYPES[spec.dtype], group.device
        kernels = kernels_for(device, dtype, spec.native_kernels, spec.triton_attention)
        loaded = load_model_files(spec.model, dtype, group.tp)
        num_blocks, max_model_len = group.share_ints(None, 2)
        model = build_model(loaded, kernels, max_model_len, dtype, device, group.tp)
        del loaded
        runner = ModelRunner(model, kernels, num_blocks, spec.block_size, dtype, device)
        group.barrier()
        while (step := group.receive()) is not None:
            runner.run(*step)
    except Exception as e:  # noqa: BLE001 - rank 0 sees the failure as RankFailed
        log.error("tensor-parallel worker failed: %s: %s", type(e).__name__, e)
        return 1
    dist.destroy_process_group()
    return 0
