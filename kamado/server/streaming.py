"""Server-sent events, and running a handler's generation so a vanished client cancels it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request

from kamado.server.errors import error_body

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
# An SSE comment: clients ignore it, but it shows the connection is alive during a long
# prefill (minutes for an agent's first turn on a CPU), so idle-read timeouts do not fire.
HEARTBEAT = ": keep-alive\n\n"
HEARTBEAT_SECONDS = 15.0


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(message: str, type: str = "server_error", code: str | None = None) -> str:
    return sse(error_body(message, type, None, code))


async def with_heartbeats(
    items: AsyncIterator[T], interval: float = HEARTBEAT_SECONDS
) -> AsyncIterator[T | None]:
    """`items`, with a None whenever `interval` seconds pass without one."""
    pending = asyncio.ensure_future(anext(items))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(items))
    finally:
        if not pending.done():
            pending.cancel()
            # Wait, shielded from the cancellation that may have brought us here, until the
            # source has run its own cleanup (aborting the engine request).
            with anyio.CancelScope(shield=True):
                await asyncio.wait({pending})
        if not pending.cancelled():
            pending.exception()  # retrieved, so asyncio does not log it as never retrieved


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
