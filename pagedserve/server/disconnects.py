"""A client that goes away: what the server waits for ends (its engine requests aborted, its
compile cancelled), and the app answers nothing (app.py's handler)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request


class ClientDisconnected(Exception):
    pass


T = TypeVar("T")


async def unless_disconnected(awaitable: Awaitable[T], request: Request) -> T:
    """``awaitable``'s result; ClientDisconnected, with it cancelled, once the client has
    gone first (its request body read already)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watcher = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            raise ClientDisconnected()
        return work.result()
    finally:
        work.cancel()
        watcher.cancel()
