"""Bounds on what one client can take: the request body's size and the time to send it, the
size of a request's headers and the time to send them, the number of open connections, and
the memory a huge request leaves behind."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import resource
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pagedserve.server.protocol import error_body

# A request body this large leaves enough freed memory behind to hand back to the OS.
_TRIM_AFTER_BYTES = 1 << 20
# A request line and headers past this size get a 431 (h11's bound, uvicorn's default before
# httptools: llhttp has none).
MAX_HEADER_BYTES = 16 * 1024


class BodyLimit:
    """ASGI middleware that reads each HTTP request body in full before the app runs: 413 past
    ``max_bytes`` (before reading it when Content-Length says so), 408 when the body takes
    longer than ``timeout`` seconds to arrive. The app then reads the buffered body, and
    after it the client's own messages (so it still sees a disconnect)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Leading zeros are valid HTTP; past them, a length of 20 digits is too large anyway
        # (and Python refuses int() of a 4,300-digit string: a 500).
        declared = dict(scope["headers"]).get(b"content-length", b"0").lstrip(b"0") or b"0"
        if not declared.isdigit() or len(declared) > 19 or int(declared) > self.max_bytes:
            await _reject(send, 413, f"The request body is larger than {self.max_bytes} bytes "
                                     "(--max-request-bytes).")
            return
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read(receive)
        except TimeoutError:
            await _reject(send, 408, f"The request body did not arrive within {self.timeout:g} s.")
            return
        if body is None:  # the client left, or sent more than it declared
            await _reject(send, 413, f"The request body is larger than {self.max_bytes} bytes "
                                     "(--max-request-bytes).")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.app(scope, replay, send)
        finally:
            if len(body) >= _TRIM_AFTER_BYTES:
                del body
                await asyncio.to_thread(release_free_memory)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _reject(send: Send, status: int, message: str) -> None:
    payload = json.dumps(error_body(status, message, code="request_too_large" if status == 413
                                    else "request_timeout")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


def release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise: the engine raises
    its trim threshold for speed), so a huge request's parse does not stay resident."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def guarded_http(header_timeout: float, max_connections: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (llhttp's C parser, as uvicorn's "auto" and vLLM's server
    use: h11, in Python, took more of the server's CPU a request and a token) with two bounds it
    lacks: a client must send each request's headers within ``header_timeout`` seconds of
    connecting (or of its previous response), so idle and half-sent connections close; and
    past ``max_connections`` open connections, a new one is answered 503 and closed at once,
    before it can hold a file descriptor for long. Headers past MAX_HEADER_BYTES get a 431,
    and a request the parser refuses a 400, in OpenAI's error shape."""

    class GuardedHTTPProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None  # armed while headers are awaited
        _header_bytes = 0  # of a request line and headers not yet complete (the parser
        # buffers them without a bound)
        _field_bytes = 0  # of this request's target and header fields, as the parser
        # hands them over: a line and headers that arrive whole in one read are never
        # incomplete

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._field_bytes = 0

        def on_url(self, url: bytes) -> None:
            self._field_bytes += len(url)
            if self._field_bytes > MAX_HEADER_BYTES:
                raise _HeadersTooLarge
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._field_bytes += len(name) + len(value) + 4  # ": " and CRLF
            if self._field_bytes > MAX_HEADER_BYTES:  # aborts the parse: the parser error
                raise _HeadersTooLarge  # reaches send_400_response, which answers 431
            super().on_header(name, value)

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                _write_error(transport, 503, "Service Unavailable",
                             "Too many open connections; retry later.",
                             "too_many_connections", retry_after=True)
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            in_body = cycle is not None and cycle.more_body  # a body has its own bounds
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are complete
                self._disarm()
                self._header_bytes = 0
            elif not in_body:  # the next request's line and headers, perhaps while the
                # response to the last one is still being written
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                    _headers_too_large(self.transport)

        def on_response_complete(self) -> None:
            cycle = self.cycle
            pipelined = bool(self.pipeline)  # requests that arrived during this response
            self._arm()
            super().on_response_complete()
            if self.cycle is not cycle or pipelined:  # a pipelined request started at once
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """A request the parser cannot take (a bad Content-Length, a bad chunk, headers
            past the bound)."""
            if self.transport.is_closing():
                return
            if self._field_bytes > MAX_HEADER_BYTES:
                _headers_too_large(self.transport)
                return
            _write_error(self.transport, 400, "Bad Request", f"Invalid HTTP request: {msg}",
                         "invalid_http_request")

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedHTTPProtocol


class _HeadersTooLarge(Exception):
    pass


def _headers_too_large(transport: Any) -> None:
    _write_error(transport, 431, "Request Header Fields Too Large",
                 f"The request's line and headers exceed {MAX_HEADER_BYTES} bytes.",
                 "request_headers_too_large")


def _write_error(transport: Any, status: int, reason: str, message: str, code: str,
                 retry_after: bool = False) -> None:
    """An OpenAI-shaped error written straight to the socket, and the connection closed."""
    payload = json.dumps(error_body(status, message, code=code)).encode()
    retry = "Retry-After: 1\r\n" if retry_after else ""
    transport.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                    f"Connection: close\r\n{retry}Content-Length: {len(payload)}\r\n\r\n"
                    .encode() + payload)
    transport.close()


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (as vLLM does), so
    that many concurrent clients do not exhaust it; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft
