"""Answering an accepted request from its generation: server-sent events as they come, or
one JSON body once it is done. Either way the request's lease is released however the
answer ends, and a client that goes away cancels the generation (freeing its KV blocks).
A stream that has nothing to send for a while (a long prefill, or a tool call held back
until it parses) sends a keep-alive comment, so clients' idle-read timeouts do not fire."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from kamado.server.errors import from_generation_failure
from kamado.server.state import Lease
from kamado.server.streaming import (
    DONE,
    HEARTBEAT,
    ClientGone,
    sse_error,
    unless_disconnected,
    with_heartbeats,
)

# Proxies must pass each event on as it comes, not buffer the stream.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _ended_properly(
    events: AsyncIterator[str], lease: Lease, heartbeat_s: float
) -> AsyncIterator[str]:
    """`events` with heartbeats, then [DONE]. Once the headers are gone a failure can only
    be told in the stream: an error event, then [DONE]."""
    try:
        async with aclosing(events), aclosing(with_heartbeats(events, heartbeat_s)) as beats:
            async for event in beats:
                yield HEARTBEAT if event is None else event
        yield DONE
    except Exception as e:
        err = from_generation_failure(e)
        yield sse_error(err.message, err.type, err.code)
        yield DONE
    finally:
        lease.release()


async def respond(
    request: Request,
    lease: Lease,
    headers: dict[str, str],
    stream: bool,
    events: Callable[[], AsyncIterator[str]],
    collect: Callable[[], Awaitable[BaseModel]],
    heartbeat_s: float,
) -> Response:
    """The answer: `events()` streamed when the client asked to stream, a heartbeat after
    every `heartbeat_s` without an event, else `collect()`'s result as one body (HTTP 499
    where the client left first)."""
    if stream:
        return StreamingResponse(
            _ended_properly(events(), lease, heartbeat_s),
            media_type="text/event-stream",
            headers={**STREAM_HEADERS, **headers},
            # Also released here: a stream cancelled before it started never runs its finally.
            background=BackgroundTask(lease.release),
        )
    try:
        result = await unless_disconnected(request, collect())
    except ClientGone:
        return JSONResponse({}, status_code=499)
    except Exception as e:
        raise from_generation_failure(e) from None
    finally:
        lease.release()
    return JSONResponse(result.model_dump(), headers=headers)
