"""--max-queue: the engine requests submitted and not finished, counted as each server admits
and settles them. Several API servers share one engine, and so one count, in shared memory:
each server's own count, or the engine's last Snapshot, lags behind a burst spread over
them, and every server would admit up to the limit."""

from __future__ import annotations

import contextlib
from typing import Any


class QueueFull(RuntimeError):
    """More unfinished requests than --max-queue allows."""


class QueueLimit:
    def __init__(self, max_queue: int | None, shared: Any | None = None):
        self.max_queue = max_queue
        self.shared = shared  # a multiprocessing Value("q") every server counts in, or None
        self.own = 0  # this server's

    def admit(self, n: int) -> None:
        """Count ``n`` more requests, or raise QueueFull (and count none)."""
        with self._lock():
            unfinished = self.own if self.shared is None else self.shared.value
            if self.max_queue is not None and unfinished + n > self.max_queue:
                raise QueueFull(f"{unfinished} requests are unfinished "
                                f"(--max-queue {self.max_queue}); retry later")
            if self.shared is not None:
                self.shared.value += n
            self.own += n

    def release(self, n: int) -> None:
        with self._lock():
            if self.shared is not None:
                self.shared.value -= n
            self.own -= n

    def _lock(self) -> contextlib.AbstractContextManager[Any]:
        return self.shared.get_lock() if self.shared is not None else contextlib.nullcontext()
