"""The worker processes that rank 0 spawns on this host for tensor parallelism: starting
them, waiting for them to join, tying their lives to rank 0's process, and noticing when
one exits (engine/distributed.py runs the collectives between the ranks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# Ctrl-C, or a SIGTERM sent to the process group (or by torchrun), reaches every rank: the
# workers ignore both, since rank 0 drains its requests first and then sends them STOP.
# Set before torch's import (seconds), so that a starting worker is exposed only briefly.
_WORKER_CODE = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "from pagedserve.engine import distributed as d; d.spawned_main()")
_LIFELINE_ENV = "PAGEDSERVE_TP_LIFELINE"
_JOIN_POLL_S = 0.05


class RankFailed(RuntimeError):
    """A rank died, hung past the timeout, or failed mid-step: the ranks are out of step
    and the engine cannot go on."""


def ignore_stop_signals() -> None:
    """A rank >= 1 (main thread): SIGINT and SIGTERM are rank 0's to act on."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def joined_key(rank: int) -> str:
    return f"pagedserve/joined/{rank}"


def spawn(size: int, port: int) -> tuple[list[subprocess.Popen], int]:
    """Ranks 1..size-1 as fresh interpreters given the ``env://`` variables torchrun sets,
    and the write end of their lifeline: a pipe only this process holds, whose end (this
    process gone, however it ended) makes them exit. PR_SET_PDEATHSIG would fire when the
    *thread* that spawned them exits (an engine built in a thread)."""
    read_end, write_end = os.pipe()  # not inherited, but by the workers (pass_fds)
    workers: list[subprocess.Popen] = []
    try:
        for rank in range(1, size):
            workers.append(subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE], pass_fds=(read_end,),
                env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                         RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size),
                         **{_LIFELINE_ENV: str(read_end)})))
    except BaseException:
        stop(workers)
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return workers, write_end


def exit_with_parent() -> None:
    """A spawned worker: exit as soon as rank 0's process is gone (the lifeline's end)."""
    fd = int(os.environ.pop(_LIFELINE_ENV))

    def watch() -> None:
        while os.read(fd, 1):  # rank 0 never writes: b"" is its end
            pass
        os._exit(1)

    threading.Thread(target=watch, name="pagedserve-lifeline", daemon=True).start()


def await_joins(store: Any, workers: list[subprocess.Popen], timeout: timedelta) -> None:
    """Rank 0: wait until every spawned worker has reached the store; RankFailed at once for
    one that exits first (not after the whole start-up timeout), or once ``timeout`` ends."""
    keys = {rank: joined_key(rank) for rank in range(1, len(workers) + 1)}
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(list(keys.values())):
        for rank, p in enumerate(workers, 1):
            if p.poll() is not None:
                raise RankFailed(f"tensor-parallel rank {rank} (pid {p.pid}) exited with "
                                 f"{exit_status(p.returncode)} before it joined")
        if time.monotonic() > deadline:
            late = [rank for rank, key in keys.items() if not store.check([key])]
            raise RankFailed(f"tensor-parallel rank(s) {', '.join(map(str, late))} did not "
                             f"join within {timeout.total_seconds():g} s")
        time.sleep(_JOIN_POLL_S)


def exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        return signal.Signals(-code).name
    return f"status {code}"


def describe_exits(workers: list[subprocess.Popen], grace_s: float = 1.0) -> str:
    """Which spawned ranks have exited, and how, as " [...]" (given ``grace_s`` to be reaped:
    a collective may notice a closed connection before the process is gone)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and all(p.poll() is None for p in workers):
        time.sleep(0.05)
    dead = [f"rank {i + 1} (pid {p.pid}) exited with {exit_status(p.poll())}"
            for i, p in enumerate(workers) if p.poll() is not None]
    return f" [{'; '.join(dead)}]" if dead else ""


def watch_exits(workers: list[subprocess.Popen], on_exit: Callable[[], None]) -> None:
    """Call ``on_exit()`` from a thread of each worker's own when that worker exits (waitid
    with WNOWAIT: the exit is seen, the process left for Popen to reap)."""
    def watch(pid: int) -> None:
        with contextlib.suppress(ChildProcessError):  # already reaped: it has exited too
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        on_exit()

    for p in workers:
        threading.Thread(target=watch, args=(p.pid,), name="pagedserve-tp-watch",
                         daemon=True).start()


def stop(workers: list[subprocess.Popen], wait_s: float = 0.0) -> None:
    """Wait up to ``wait_s`` for each worker to exit, then kill what is left (they ignore
    SIGTERM)."""
    for p in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=wait_s)
        if p.poll() is None:
            p.kill()
            p.wait()
