"""Request handling pieces that need no model: body limits, error shapes, token budgets."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from kamado.server.decoding import decode_body, read_body
from kamado.server.errors import APIError
from kamado.server.protocol import ChatCompletionRequest
from kamado.server.request_params import fit_max_tokens


def request_with(body: bytes, declared: int | None = None) -> Request:
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    length = len(body) if declared is None else declared
    headers = [(b"content-length", str(length).encode())]
    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


async def test_body_over_the_limit_is_413():
    assert await read_body(request_with(b"x" * 10), limit=10) == b"x" * 10
    with pytest.raises(APIError) as e:
        await read_body(request_with(b"x" * 11), limit=10)
    assert e.value.status == 413
    with pytest.raises(APIError):  # refused on the declared length alone
        await read_body(request_with(b"{}", declared=10**9), limit=10)


def test_validation_errors_name_the_nested_field():
    body = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'
    with pytest.raises(APIError) as e:
        decode_body(body, ChatCompletionRequest)
    assert e.value.param == "messages[0].content[0].text"
    assert "messages[0].content[0].text" in e.value.message


def test_unknown_fields_are_accepted():
    req = decode_body(
        b'{"messages": [{"role": "user", "content": "x", "cache_control": {}}], "store": true}',
        ChatCompletionRequest,
    )
    assert req.messages[0].content == "x"


@pytest.mark.parametrize(
    ("prompt", "requested", "default", "expected", "clamped"),
    [
        (100, 4096, None, 412, 4096),  # CLIENTS.md 12: clamp, do not refuse
        (100, 50, None, 50, None),
        (100, None, None, 412, None),  # chat: no max_tokens means "up to the context"
        (100, None, 16, 16, None),  # completions: OpenAI's default of 16
        (511, 10, None, 1, 10),
    ],
)
def test_fit_max_tokens(prompt, requested, default, expected, clamped):
    budget = fit_max_tokens(prompt, 512, requested, default)
    assert (budget.max_tokens, budget.clamped_from) == (expected, clamped)


def test_prompt_filling_the_context_is_refused():
    with pytest.raises(APIError) as e:
        fit_max_tokens(512, 512, 10, None)
    assert e.value.code == "context_length_exceeded" and "512" in e.value.message


async def test_heartbeats_fill_long_waits_and_cleanup_runs():
    import asyncio
    from contextlib import aclosing

    from kamado.server.streaming import with_heartbeats

    closed = []

    async def slow():
        try:
            yield 1
            await asyncio.sleep(0.35)
            yield 2
            await asyncio.sleep(10)
            yield 3
        finally:
            closed.append(True)

    got = []
    async with aclosing(slow()) as items:
        async for item in with_heartbeats(items, interval=0.1):
            got.append(item)
            if item == 2:
                break
    assert got[0] == 1 and got[-1] == 2 and got.count(None) >= 2
    assert closed == [True]
