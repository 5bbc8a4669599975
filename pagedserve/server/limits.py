"""Bounds on what one client can take: the request body's size and the time to send it, the
time to send a request's headers, the number of open connections, and the memory a huge
request leaves behind."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import resource
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.server.protocol import error_body

# A request body this large leaves enough freed memory behind to hand back to the OS.
_TRIM_AFTER_BYTES = 1 << 20


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
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_bytes:
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


def guarded_h11(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with two bounds it lacks: a client must send each request's
    headers within ``header_timeout`` seconds of connecting (or of its previous response),
    so idle and half-sent connections close; and past ``max_connections`` open
    connections, a new one is answered 503 and closed at once, before it can hold a file
    descriptor for long."""

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                payload = json.dumps(error_body(503, "Too many open connections; retry later.",
                                                code="too_many_connections")).encode()
                transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                                b"application/json\r\nConnection: close\r\nRetry-After: 1\r\n"
                                b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n"
                                + payload)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are complete
                self._disarm()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            self._arm()
            super().on_response_complete()
            if self.cycle is not cycle:  # a pipelined request started at once
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse (a bad Content-Length, a bad chunk): uvicorn's
            plain-text 400, in OpenAI's error shape like every other refusal."""
            payload = json.dumps(error_body(400, f"Invalid HTTP request: {msg}",
                                            code="invalid_http_request")).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(payload)).encode())]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=payload), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

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

    return GuardedH11Protocol


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (as vLLM does), so
    that many concurrent clients do not exhaust it; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft
