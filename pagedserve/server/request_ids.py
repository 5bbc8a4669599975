"""Request ids a client chooses, as vLLM takes them: a response's ``id`` is built on the
``X-Request-Id`` header, else the body's ``request_id``, else a fresh one; and with
``--enable-request-id-headers`` every response carries ``X-Request-Id`` (the client's own,
or a new one), so a proxy's logs and the server's meet."""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.server.protocol import MAX_REQUEST_ID_CHARS, APIError


def base_request_id(request: Request, body_id: str | None) -> str:
    """The id a response's ``id`` is built on (``cmpl-<it>``, ``chatcmpl-<it>``): the one
    the client sent, else the one RequestIdHeader gave the response, else a fresh one. (The
    body's is held to MAX_REQUEST_ID_CHARS by its schema too, in /openapi.json.)"""
    sent = (("X-Request-Id", request.headers.get("x-request-id")), ("request_id", body_id))
    for name, value in sent:
        if value:
            if len(value) > MAX_REQUEST_ID_CHARS:
                raise APIError(400, f"{name} is longer than {MAX_REQUEST_ID_CHARS} characters.",
                               param="request_id", code="invalid_value")
            return value
    return getattr(request.state, "request_id", None) or uuid.uuid4().hex


class RequestIdHeader:
    """Adds ``X-Request-Id`` to each HTTP response, streamed ones and errors included (a
    plain ASGI middleware: no buffering of a stream)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex
        # For the 500 handler, which Starlette runs outside every middleware.
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
