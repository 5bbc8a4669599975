"""Tensor parallelism over torch.distributed: starting the ranks, each step's broadcast, and
the loop the other ranks run.

Rank 0 holds the engine (scheduler, block manager, sampling); ranks 1..N-1 hold only their
shard of the weights and of the KV pool, at the same block ids, and run every forward that
rank 0 runs. Rank 0 either spawns them on this host, or they were started by ``torchrun``
(``env://``: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), so that they can live on other
hosts; then rank 0 runs the CLI command and the other ranks run ``worker_main``. Spawned
ranks are fresh interpreters given the same ``env://`` variables torchrun sets, so both ways
share one code path (torch.multiprocessing's spawn would re-import the parent's __main__,
which starts a script without a main guard all over again in every worker).

Three process groups: ``control`` (gloo, CPU) carries the start-up messages and each step's
fixed-size header, and has no practical timeout, since an idle server sends nothing; ``data``
carries each step's packed tensor, the all-reduces and the logits gather: gloo on CPU, NCCL
on CUDA, with ``timeout_s``, so a rank that dies or hangs fails the step instead of hanging
it (RankFailed, after which the engine is dead)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.device_setup import DTYPES
from pagedserve.engine.model_runner import (
    HEADER_LEN,
    STOP,
    ModelRunner,
    build_model,
    payload_sizes,
)
from pagedserve.kernels import kernels_for
from pagedserve.models.loader import load_model_files
from pagedserve.models.parallel import TensorParallel

log = logging.getLogger("pagedserve.distributed")

# An idle server broadcasts nothing: the other ranks wait for the next header this long.
IDLE_TIMEOUT = timedelta(days=3650)
# A rank's interpreter and torch import take seconds, more on a busy host.
START_TIMEOUT = timedelta(seconds=120)


class RankFailed(RuntimeError):
    """A rank died, hung past the timeout, or failed mid-step: the ranks are out of step
    and the engine cannot go on."""


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
                 step_timeout: timedelta, workers: list[Any] | None = None):
        self.rank, self.size, self.device = rank, size, device
        self.control, self.data = control, data
        self.step_timeout = step_timeout
        self.tp = TensorParallel(rank, size, data)
        self.workers = workers or []  # spawned worker processes (rank 0 without torchrun)
        self.failed: str | None = None
        self.closed = False

    # ---- start-up (control group) -------------------------------------------------------
    def share_ints(self, values: list[int] | None, count: int) -> list[int]:
        """Rank 0's ``values`` on every rank."""
        t = torch.tensor(values if self.rank == 0 else [0] * count, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.control)
        return t.tolist()

    def barrier(self) -> None:
        dist.barrier(group=self.control)

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
        # its next receive would hold rank 0 for the control group's idle timeout (years).
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
            self.failed = f"a tensor-parallel step failed: {e}{self._dead_workers()}"
            raise RankFailed(self.failed) from e

    def _dead_workers(self) -> str:
        """Which spawned ranks have exited, and how (given a second to be reaped: the
        collective may notice a closed connection before the process is gone)."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and all(p.poll() is None for p in self.workers):
            time.sleep(0.05)
        dead = [f"rank {i + 1} (pid {p.pid}) exited with {_exit_status(p.poll())}"
                for i, p in enumerate(self.workers) if p.poll() is not None]
        return f" [{'; '.join(dead)}]" if dead else ""

    # ---- shutdown -----------------------------------------------------------------------
    def close(self) -> None:
        """Rank 0: tell the other ranks to stop and wait for the spawned ones (killing them
        after a failure, when they may be stuck in a collective)."""
        if self.closed:
            return
        self.closed = True
        if not self.failed:
            with contextlib.suppress(Exception):
                self._send_header([STOP] + [0] * (HEADER_LEN - 1))
        for p in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30 if not self.failed else 0)
            if p.poll() is None:
                p.kill()
                p.wait()
        with contextlib.suppress(Exception):  # so that a later engine can start its own
            dist.destroy_process_group()


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        return signal.Signals(-code).name
    return f"status {code}"


def _join(rank: int, size: int, init_method: str, local_rank: int,
          spec: WorkerSpec | None = None, workers: list[Any] | None = None
          ) -> tuple[Group, WorkerSpec]:
    """Every rank: rendezvous, make the groups (in the same order everywhere) and receive
    rank 0's spec."""
    # Rank 0 gives up on a rendezvous that takes longer than START_TIMEOUT (a worker that
    # never started); the others wait as long as rank 0 takes to get there.
    timeout = START_TIMEOUT if spec else IDLE_TIMEOUT
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    box: list[Any] = [spec]
    dist.broadcast_object_list(box, src=0, group=control)
    spec = box[0]
    device = _device(spec.device, local_rank)
    step_timeout = timedelta(seconds=spec.timeout_s)
    data = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo",
                          timeout=step_timeout)
    return Group(rank, size, device, control, data, step_timeout, workers), spec


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
    port = _free_port()
    workers = [subprocess.Popen(
        [sys.executable, "-c", "from pagedserve.engine import distributed as d; d.spawned_main()"],
        env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                 LOCAL_RANK=str(rank), WORLD_SIZE=str(size), PAGEDSERVE_TP_PARENT=str(os.getpid())))
        for rank in range(1, size)]
    try:
        group = _join(0, size, f"tcp://127.0.0.1:{port}", 0, spec, workers)[0]
    except BaseException:
        for p in workers:
            p.kill()
            p.wait()
        raise
    atexit.register(group.close)
    return group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def die_with_parent(parent: int | None = None) -> None:
    """Linux: this process is killed when its parent dies (a worker or engine process left
    behind would hold its memory and its device); and exits now if its parent, pid
    ``parent``, died before that was set up (the start-up of a spawned process takes
    seconds)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        sys.exit(1)


def spawned_main() -> None:
    """A rank that rank 0 spawned on this host."""
    die_with_parent(int(os.environ["PAGEDSERVE_TP_PARENT"]))
    sys.exit(worker_main())


def worker_main() -> int:
    """A rank >= 1 started by torchrun: serve rank 0's steps until it says stop."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return _serve(rank, size, "env://", int(os.environ.get("LOCAL_RANK", rank)))


def _serve(rank: int, size: int, init_method: str, local_rank: int) -> int:
    """Load this rank's shard, allocate its KV pool at rank 0's size, then run each step
    rank 0 broadcasts. 0 when rank 0 said stop; 1 (and a log line) on any failure."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s: rank {rank}: %(message)s")
    try:
        group, spec = _join(rank, size, init_method, local_rank)
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
