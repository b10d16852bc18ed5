"""Hostile input: random bodies built from the request schema, and by hand the things a
broken or malicious client sends. The server answers each with a 4xx or a correct reply,
never crashes, and leaks no KV blocks, requests or memory."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kamado.server.decoding import MAX_BODY_BYTES
from kamado.server.protocol import ChatCompletionRequest
from tests.server.conftest import Server, start_server

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]
MAX_NUM_SEQS, MAX_QUEUED = 4, 12


@pytest.fixture(scope="module")
def server(smollm2_path):
    args = ("--max-model-len", "256", "--max-num-seqs", str(MAX_NUM_SEQS))
    yield from start_server(smollm2_path, *args, "--max-queued", str(MAX_QUEUED))


def chat(server: Server, body: bytes | dict, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **headers}
    url = server.url + "/v1/chat/completions"
    return httpx.post(url, content=content, headers=headers, timeout=120)


def assert_client_error(r: httpx.Response, status: int | None = None) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if status is not None:
        assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert error["message"] and error["type"]


def server_rss_bytes(server: Server) -> int:
    total = 0
    for pid in [server.proc.pid, server.engine_pid()]:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def settle(server: Server) -> None:
    """Wait until nothing is in flight; then no KV block may be held."""
    deadline = time.monotonic() + 60
    while server.metric("kamado_requests_in_flight") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("kamado_requests_in_flight") == 0
    # The engine reports its blocks after it handles the last abort, a moment later.
    while server.metric("kamado_kv_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("kamado_kv_blocks_used") == 0


# ---- random bodies from the request schema ---------------------------------------------

ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
# Long replies would make each example slow; max_tokens gets values that are wrong or small.
MAX_TOKENS = st.one_of(st.integers(min_value=-3, max_value=3), st.sampled_from([1.5, "2", [], {}]))
MESSAGES = st.one_of(
    st.just(HI),
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot", 7])},
            optional={"content": ODD_VALUES, "tool_calls": ODD_VALUES, "name": ODD_VALUES},
        ),
        max_size=3,
    ),
    ODD_VALUES,
)
FIELDS = sorted(set(ChatCompletionRequest.model_fields) - {"messages", "max_tokens", "stream"})


@st.composite
def chat_bodies(draw) -> dict:
    body = {"messages": draw(MESSAGES), "max_tokens": draw(MAX_TOKENS)}
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[field] = draw(ODD_VALUES)
    if draw(st.booleans()):
        body["max_completion_tokens"] = 2
    return body


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=chat_bodies())
def test_random_bodies_get_a_4xx_or_a_reply(server, body):
    r = chat(server, body)
    if r.status_code == 200:
        reply = r.json()
        assert reply["choices"] and reply["usage"]["completion_tokens"] >= 0
    else:
        assert_client_error(r)


# ---- by hand ---------------------------------------------------------------------------


def test_huge_bodies_are_refused_before_they_are_read(server):
    size = MAX_BODY_BYTES + (1 << 20)
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * size + b'"}]}'
    assert_client_error(chat(server, big), 413)

    def chunks():  # no Content-Length: the limit holds while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(size >> 20):
            yield b"a" * (1 << 20)
        yield b'"}]}'

    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert_client_error(r, 413)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"messages": [{"role": "user", "content": "hi", "x": '
        + b'{"a": ' * 50_000
        + b"1"
        + b"}" * 50_000
        + b"}]}",
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e308}',
        b'{"messages": [{"role": "user", "content": "hi"}], "n": 1000000000}',
        b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 400 + b"}",
        b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 1000000, '
        b'"logprobs": true}',
        b'{"messages": [{"role": "user", "content": "hi"}]',
        b"\x00\x01\x02",
    ],
    ids=[
        "nested-arrays",
        "nested-objects",
        "invalid-utf8",
        "nan",
        "infinity",
        "float-max-tokens",
        "huge-n",
        "400-digit-seed",
        "huge-top-logprobs",
        "truncated",
        "binary",
    ],
)
def test_malicious_bodies(server, raw):
    assert_client_error(chat(server, raw))


def test_thousands_of_stop_strings(server):
    body = {"messages": HI, "max_tokens": 2, "stop": [f"s{i}" for i in range(5000)]}
    r = chat(server, body)
    assert_client_error(r)
    assert "stop" in r.json()["error"]["message"]


def test_a_prompt_far_beyond_the_context(server):
    body = {"messages": [{"role": "user", "content": "word " * 300_000}], "max_tokens": 2}
    r = chat(server, body)
    assert_client_error(r, 400)
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_slow_client_does_not_hold_up_others(server):
    """A client that trickles its body in byte by byte occupies one connection, nothing more."""
    body = json.dumps({"messages": HI, "max_tokens": 2}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(head + body[:5])
        started = time.monotonic()
        r = chat(server, {"messages": HI, "max_tokens": 2})
        assert r.status_code == 200 and time.monotonic() - started < 30
        slow.sendall(body[5:])
        assert b"200 OK" in slow.recv(4096)
    settle(server)


def test_mid_stream_disconnects_leak_nothing(server):
    for _ in range(6):
        body = {"messages": HI, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # leave mid-stream
    settle(server)


def test_200_concurrent_connections(server):
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 3}
        return await client.post(server.url + "/v1/chat/completions", json=body)

    async def all_at_once() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    rss_before = server_rss_bytes(server)
    replies = asyncio.run(all_at_once())
    ok = [r for r in replies if r.status_code == 200]
    full = [r for r in replies if r.status_code == 503]
    assert len(ok) + len(full) == 200
    assert len(ok) >= MAX_NUM_SEQS + MAX_QUEUED  # everything admitted was served
    assert all(r.json()["choices"][0]["message"]["content"] is not None for r in ok)
    assert all(r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] for r in full)
    settle(server)
    assert server_rss_bytes(server) - rss_before < 200 << 20


def test_still_serving_after_all_that(server):
    r = chat(server, {"messages": HI, "max_tokens": 2})
    assert r.status_code == 200
    settle(server)
