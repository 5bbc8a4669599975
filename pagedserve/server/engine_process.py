"""The engine process's side of its pipes: commands in from each API server process, events
out to each (``--frontend-multiprocessing``; with ``--api-server-count N``, N pairs of pipes
to one engine). With several servers, each names its request groups ``s<index>-...``
(``server_of``): an event about a group goes to its server alone, the rest to all."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import logging
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from pagedserve.engine import LLMEngine
from pagedserve.engine.distributed import die_with_parent
from pagedserve.server.engine_loop import EngineLoop
from pagedserve.server.engine_messages import Added, Command, Delivered, Event, Failed, Stop

log = logging.getLogger("pagedserve.server")
EXIT_JOIN_S = 5.0  # what an exit that skipped the shutdown gives the engine process


def engine_pipes(context: Any) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """(commands read end, write end), (events read end, write end) for one server."""
    commands, events = context.Pipe(duplex=False), context.Pipe(duplex=False)
    # A step's message is a few KB: at Linux's default 64 KiB a server that lags a dozen
    # steps would block the engine's writes, and a long prompt or two the server's; 1 MiB
    # (the usual limit) is slack.
    for conn in (commands[1], events[1]):
        with contextlib.suppress(OSError):
            fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
    return commands, events


def server_of(group_id: str) -> int:
    """The index of the API server whose group this is ("s2-r7" -> 2; one server: 0)."""
    return int(group_id[1:group_id.index("-")]) if group_id.startswith("s") else 0


def _by_server(items: list[Any], group_of: Callable[[Any], str]) -> dict[int, list[Any]]:
    parts: dict[int, list[Any]] = {}
    for item in items:
        parts.setdefault(server_of(group_of(item)), []).append(item)
    return parts


class PipeInbox:
    """Commands from the servers' ends of their pipes. A server's Stop, or the end of its
    pipe (it exited), closes that pipe alone: the loop sees Stop once every one is closed.
    The requests of a server that left unasked run to their end unread."""

    def __init__(self, conns: list[Any]):
        self.open = dict(enumerate(conns))
        # wake() writes a byte here (from a compile thread); take() waits on it too.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    def take(self, block: bool) -> list[Command]:
        if block and self.open and self._wake_read in wait([*self.open.values(),
                                                             self._wake_read]):
            os.read(self._wake_read, 4096)  # a wake left unread costs one more pass
        commands: list[Command] = []
        for index, conn in list(self.open.items()):
            try:
                while conn.poll():
                    command = conn.recv()
                    if isinstance(command, Stop):
                        self._close(index)
                        break
                    commands.append(command)
            except (EOFError, OSError):
                self._close(index)
        if not self.open:
            commands.append(Stop())
        return commands

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: a wake is pending already
            os.write(self._wake_write, b"w")

    def _close(self, index: int) -> None:
        self.open.pop(index).close()


class EventPipes:
    """Each iteration's events, sent to the server(s) they concern; with several servers,
    none to one that has stopped (its inbox pipe is closed)."""

    def __init__(self, conns: list[Any], inbox: PipeInbox):
        self.conns = dict(enumerate(conns))
        self.inbox = inbox

    def emit(self, events: list[Event]) -> None:
        if len(self.conns) == 1:  # one server: every event is its own
            (index,) = self.conns
            self._send(index, events)
            return
        out: dict[int, list[Event]] = {index: [] for index in self.conns}
        for event in events:
            if isinstance(event, Delivered):
                for index, items in _by_server(event.items, lambda item: item[0]).items():
                    out.get(index, []).append(Delivered(items))
            elif isinstance(event, Failed):
                for index, group_ids in _by_server(event.group_ids, str).items():
                    out.get(index, []).append(dataclasses.replace(event, group_ids=group_ids))
            elif isinstance(event, Added):
                out.get(server_of(event.group_id), []).append(event)
            else:  # Loaded, Snapshot, StateChanged, Died: every server's
                for part in out.values():
                    part.append(event)
        for index, part in out.items():
            if part and index in self.inbox.open:
                self._send(index, part)

    def _send(self, index: int, events: list[Event]) -> None:
        try:
            self.conns[index].send(events)
        except OSError:  # that server has exited; its pipe's end tells the inbox too
            log.warning("API server %d is gone; its events are dropped", index)
            del self.conns[index]


def run_engine_process(factory: Callable[[], LLMEngine], commands: list[Any],
                       events: list[Any], log_level: int, parent: int | None = None) -> None:
    """The engine process's main: the loop over a pair of pipes to each API server."""
    die_with_parent(parent)
    # Ctrl-C, or a SIGTERM sent to the whole process group, is the servers' to act on: they
    # drain their streams, then stop the engine (Stop; a closed pipe reads as Stop too).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s: %(message)s")
    inbox = PipeInbox(commands)
    EngineLoop(factory, inbox, EventPipes(events, inbox).emit).run()


def end_at_exit(process: Any, close_commands: Callable[[], None]) -> None:
    """At the server's exit, end its engine process if it still runs: a forced exit (a
    second Ctrl-C) skips the shutdown that stops it, and multiprocessing's own exit handler
    would SIGTERM it, which it ignores, then wait for it forever. The end of the command
    pipe reads as Stop there; a process still running past EXIT_JOIN_S is killed.
    Registered after multiprocessing's handler, this one runs first."""
    def end() -> None:
        if process.is_alive():
            close_commands()
            process.join(EXIT_JOIN_S)
            if process.is_alive():
                process.kill()

    atexit.register(end)
