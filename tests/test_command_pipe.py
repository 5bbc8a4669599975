"""The command pipe's writer (server/command_pipe.py): framed as multiprocessing frames a
Connection's messages, in order, and never blocking the event loop on a full pipe."""

import asyncio
import multiprocessing
import threading
import time

from pagedserve.server.command_pipe import CommandWriter
from pagedserve.server.engine_messages import Abort, Stop


def test_commands_arrive_whole_and_in_order_without_blocking_the_loop():
    """A command far larger than the pipe is queued at once; the loop stays free while the
    reader, starting late, takes it and those after it; the pipe closes after Stop."""
    reader_end, writer_end = multiprocessing.Pipe(duplex=False)
    big = Abort([f"request-{i}" for i in range(200_000)])  # ~3 MB pickled; a pipe: 64 KiB
    commands = [Abort(["first"]), big, Abort(["after the big one"]), Stop()]
    received: list[object] = []

    def read() -> None:
        time.sleep(0.3)  # the writer has long returned by now
        try:
            while True:
                received.append(reader_end.recv())
        except EOFError:
            pass

    async def write() -> float:
        writer = CommandWriter(asyncio.get_running_loop(), writer_end)
        start = time.perf_counter()
        for command in commands[:-1]:
            writer.send(command)
        writer.close_after(commands[-1])
        took = time.perf_counter() - start
        while not writer_end.closed:  # the loop turns (and writes) meanwhile
            await asyncio.sleep(0.01)
        return took

    thread = threading.Thread(target=read)
    thread.start()
    took = asyncio.run(write())
    thread.join(10)
    assert took < 0.25, "send() waited for the reader"
    assert received == commands


def test_a_reader_gone_drops_the_commands_quietly():
    reader_end, writer_end = multiprocessing.Pipe(duplex=False)
    reader_end.close()

    async def write() -> None:
        writer = CommandWriter(asyncio.get_running_loop(), writer_end)
        writer.send(Abort(["nobody reads this"]))  # EPIPE: the events pipe reports the loss
        writer.send(Abort(["nor this"]))

    asyncio.run(write())
    assert writer_end.closed
