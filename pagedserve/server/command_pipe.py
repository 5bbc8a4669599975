"""The command pipe to the engine process, written by the event loop itself.

A command is pickled and framed as ``multiprocessing.Connection.send`` frames it, so the
engine process reads it with ``Connection.recv`` (engine_loop.PipeInbox). The write end is
non-blocking: what the pipe cannot take at once (a long prompt while the engine is inside a
step) waits here, in order, and goes out when the pipe drains. So the event loop never
blocks on the engine, and no thread hands each command over: a sender thread cost every
request a GIL hand-off with the event loop.
"""

from __future__ import annotations

import asyncio
import os
import struct
from multiprocessing.reduction import ForkingPickler
from typing import Any


def _header(size: int) -> bytes:
    """What Connection.send_bytes writes before a payload: its size as a signed 32-bit
    big-endian int, or -1 and a 64-bit size for a payload of 2 GiB or more."""
    if size > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", size)
    return struct.pack("!i", size)


class CommandWriter:
    """Sends commands down ``conn`` (a Connection's write end) from ``loop``'s thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: Any):
        self._loop = loop
        self._conn = conn
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._pending = bytearray()
        self._watching = False  # a writer callback waits for the pipe to drain
        self._closing = False  # close once what is pending is out (after Stop)

    def send(self, command: Any) -> None:
        """Queue ``command`` behind those before it; raises what pickling raises, and then
        nothing is queued."""
        if self._closing or self._conn.closed:
            return  # stopped, or the process is gone: its end reads as EOF there
        payload = ForkingPickler.dumps(command)
        self._pending += _header(len(payload))
        self._pending += payload
        if not self._watching:
            self._write()

    def close_after(self, command: Any) -> None:
        """Send ``command`` last, then close the pipe once it is out."""
        self.send(command)
        self._closing = True
        if not self._watching:
            self._write()

    def close_now(self) -> None:
        """Close the pipe at once, from any thread (the event loop is gone): the engine
        reads the end of the pipe as Stop."""
        self._closing = True
        if not self._conn.closed:
            self._conn.close()

    def _write(self) -> None:
        try:
            while self._pending:
                written = os.write(self._fd, self._pending)
                del self._pending[:written]
        except BlockingIOError:  # the pipe is full: go on when the engine has read some
            if not self._watching:
                self._loop.add_writer(self._fd, self._write)
                self._watching = True
            return
        except OSError:  # the process is gone; the events pipe's EOF reports it
            self._pending.clear()
            self._closing = True
        if self._watching:
            self._loop.remove_writer(self._fd)
            self._watching = False
        if self._closing and not self._conn.closed:
            self._conn.close()
