"""The guarded HTTP protocol (server/limits.py) driven directly, without sockets: a client
cannot grow the parser's buffer past the header bound while a response is being written,
nor is a large body's last read mistaken for headers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from pagedserve.server.limits import MAX_HEADER_BYTES, guarded_http


class Transport(asyncio.Transport):
    """Records what the protocol writes; closing only marks it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed = b"", False

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def endless_stream(scope: Any, receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):  # the whole body first
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"x", "more_body": True})
    await asyncio.sleep(3600)  # a stream that is still being written


def connection() -> tuple[Any, Transport]:
    config = Config(endless_stream, log_level="warning")
    config.load()
    protocol = guarded_http(60.0, 100)(config, ServerState(), {}, asyncio.get_running_loop())
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


def test_headers_sent_behind_a_response_in_progress_are_bounded():
    async def run() -> tuple[int, bool, bytes]:
        protocol, transport = connection()
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.05)  # the response has started and goes on
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        while not transport.closed and sent < 64 << 20:
            protocol.data_received(b"a" * 65536)
            sent += 65536
        return sent, transport.closed, transport.written

    sent, closed, written = asyncio.run(run())
    assert closed and sent <= MAX_HEADER_BYTES + 65536, sent
    assert b"HTTP/1.1 431" in written


@pytest.mark.parametrize(("fields", "status"), [
    ([b"X-Pad: " + b"a" * (MAX_HEADER_BYTES // 2)], b"200"),
    ([b"X-Big: " + b"a" * (MAX_HEADER_BYTES + 1)], b"431"),
    ([b"X-%d: abc" % i for i in range(MAX_HEADER_BYTES // 8)], b"431"),
], ids=["under", "one-large", "many-small"])
def test_headers_that_arrive_whole_are_bounded_too(fields, status):
    """Headers complete in one read never sit in the parser's buffer, and are held to the
    same bound as those that arrive in pieces."""
    async def run() -> bytes:
        protocol, transport = connection()
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"\r\n".join(fields)
                               + b"\r\n\r\n")
        await asyncio.sleep(0.05)
        return transport.written

    assert asyncio.run(run()).startswith(b"HTTP/1.1 " + status)


@pytest.mark.parametrize("piece", [1 << 20, 4096], ids=["one-read", "in-pieces"])
def test_a_long_request_line_is_bounded_as_headers_are(piece):
    """The request's target counts: a 60 KB URL had passed the bound in one read (llhttp
    buffers no line that arrives whole), and a 100 KB one got a 400."""
    async def run() -> bytes:
        protocol, transport = connection()
        request = b"GET /?q=" + b"a" * MAX_HEADER_BYTES + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        for start in range(0, len(request), piece):
            if transport.closed:
                break
            protocol.data_received(request[start:start + piece])
        await asyncio.sleep(0.05)
        return transport.written

    assert asyncio.run(run()).startswith(b"HTTP/1.1 431")


def test_a_large_body_is_not_counted_as_headers():
    async def run() -> tuple[bytes, bool]:
        protocol, transport = connection()
        body = b"b" * (1 << 20)
        protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: "
                               + str(len(body)).encode() + b"\r\n\r\n")
        for start in range(0, len(body), 256 << 10):  # the event loop's largest read
            protocol.data_received(body[start:start + (256 << 10)])
        await asyncio.sleep(0.05)
        return transport.written, transport.closed  # (the loop's end closes it)

    written, closed = asyncio.run(run())
    assert written.startswith(b"HTTP/1.1 200") and not closed
