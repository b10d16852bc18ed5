"""Server-sent events, and running a handler's generation so a vanished client cancels it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

from kamado.server.errors import error_body

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(message: str, type: str = "server_error", code: str | None = None) -> str:
    return sse(error_body(message, type, None, code))


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) reply was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (freeing its KV blocks)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                pass
        watcher.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone
    return task.result()
