"""The threads llguidance compiles on: few, and each with a large stack.

llguidance recurses as deep as a grammar's chain of rules or a schema's chain of $refs as it
builds a grammar, and a native stack overflow kills the whole process (SIGSEGV), every
request with it. A thread's default stack (8 MiB) held a chain of ~2,000 Lark rules or ~800
$refs; 512 MiB holds ~80,000 rules, past the grammar size allowed here (limits.py), and past
the point where llguidance's own limits refuse a schema ("schema too large", 65k symbols).
The memory is reserved address space: only the pages a compile touches are ever used.

Compiles run here, not on the server's thread pool that also tokenizes prompts, so slow
ones (seconds, for a schema of 15,000 properties) hold up only each other."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger("pagedserve.structured")
STACK_BYTES = 512 << 20
NUM_THREADS = 2

_lock = threading.Lock()
_workers: tuple[int, queue.SimpleQueue] | None = None  # (the process it serves, its queue)


def submit(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on a compile thread; its result or exception in the future."""
    future: Future = Future()
    _queue().put((future, fn, args))
    return future


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a compile thread, waited for."""
    return submit(fn, *args).result()


def _queue() -> queue.SimpleQueue:
    global _workers
    with _lock:
        # Started on first use, and again in a forked child, which has none of the threads.
        if _workers is None or _workers[0] != os.getpid():
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            for i in range(NUM_THREADS):
                _start(jobs, f"pagedserve-grammar-{i}")
            _workers = (os.getpid(), jobs)
        return _workers[1]


def _start(jobs: queue.SimpleQueue, name: str) -> None:
    """A compile thread with the large stack, or where the host refuses that much address
    space (a strict overcommit policy), the largest it grants."""
    for size in (STACK_BYTES, 64 << 20, 0):
        previous = threading.stack_size(size)  # for the thread started here
        try:
            threading.Thread(target=_serve, args=(jobs,), daemon=True, name=name).start()
        except RuntimeError:  # "can't start new thread"
            continue
        finally:
            threading.stack_size(previous)
        if size != STACK_BYTES:
            log.warning("grammar compiles run on a %s stack (%d MiB refused): a deep grammar "
                        "may crash the server", f"{size >> 20} MiB" if size else "default",
                        STACK_BYTES >> 20)
        return
    raise RuntimeError("no thread could be started for grammar compiles")


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        future, fn, args = jobs.get()
        if not future.set_running_or_notify_cancel():
            del future, fn, args
            continue
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(e)
        del future, fn, args  # not held while this thread waits for the next job
