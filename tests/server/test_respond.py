"""respond: however an answer ends, its lease is released once and a stream ends in [DONE]."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from fastapi import Request
from pydantic import BaseModel

from kamado.engine.core import RequestError
from kamado.server.errors import APIError
from kamado.server.respond import respond
from kamado.server.state import Lease
from kamado.server.streaming import DONE, HEARTBEAT, sse


class Admissions:
    """Stands in for ServerState: counts the leases given back."""

    def __init__(self) -> None:
        self.released = 0

    def _release(self) -> None:
        self.released += 1


class Body(BaseModel):
    text: str


def request_that_stays() -> Request:
    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never disconnects
        return {}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


async def events_then_failure(closed: list[bool]) -> AsyncIterator[str]:
    try:
        yield sse({"text": "first"})
        raise RequestError("the engine refused this request")
    finally:
        closed.append(True)


async def answer(events, collect=None, admissions=None, heartbeat_s=60.0):
    admissions = admissions or Admissions()
    response = await respond(
        request_that_stays(), Lease(admissions), {"X-Test": "1"}, collect is None,
        events=events, collect=collect or (lambda: None), heartbeat_s=heartbeat_s,
    )  # fmt: skip
    return response, admissions


async def test_a_stream_that_fails_midway_says_so_then_ends():
    closed: list[bool] = []
    response, admissions = await answer(lambda: events_then_failure(closed))
    assert response.headers["X-Test"] == "1" and response.media_type == "text/event-stream"
    events = [e async for e in response.body_iterator]
    assert events[0] == sse({"text": "first"}) and events[-1] == DONE and len(events) == 3
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert "refused" in error["message"] and error["code"] == "invalid_request"
    assert closed == [True] and admissions.released == 1


async def test_a_stream_the_client_leaves_is_closed_and_its_lease_released():
    closed: list[bool] = []
    response, admissions = await answer(lambda: events_then_failure(closed))
    stream = response.body_iterator
    assert await anext(stream) == sse({"text": "first"})
    await stream.aclose()  # what Starlette does when the client goes away
    assert closed == [True] and admissions.released == 1


async def test_a_stream_with_nothing_to_send_keeps_the_connection_alive():
    async def slow_events() -> AsyncIterator[str]:
        yield sse({"text": "first"})
        await asyncio.sleep(0.35)  # a long prefill, or a tool call held back until it parses
        yield sse({"text": "second"})

    response, admissions = await answer(slow_events, heartbeat_s=0.1)
    events = [e async for e in response.body_iterator]
    assert events[0] == sse({"text": "first"}) and events[-2:] == [sse({"text": "second"}), DONE]
    assert set(events[1:-2]) == {HEARTBEAT} and 1 <= len(events[1:-2]) <= 4
    assert admissions.released == 1


async def test_a_collected_answer_is_one_body():
    async def collect() -> Body:
        return Body(text="all of it")

    response, admissions = await answer(None, collect)
    assert json.loads(response.body) == {"text": "all of it"} and response.headers["X-Test"] == "1"
    assert admissions.released == 1


async def test_a_collected_answer_that_fails_is_an_api_error():
    async def collect() -> Body:
        raise RequestError("the engine refused this request")

    admissions = Admissions()
    with pytest.raises(APIError, match="refused") as raised:
        await answer(None, collect, admissions)
    assert raised.value.status == 400 and admissions.released == 1
