"""Context clamping, the bounded queue, and /health that notices a stalled or dead engine.

Runs its own small server (128-token context, one sequence, no queue); the last test kills
its engine and watches the supervisor bring it back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]
STALL_S = 3


@pytest.fixture(scope="module")
def tiny_server(smollm2_path):
    args = ("--max-model-len", "128", "--max-num-seqs", "1", "--max-queued", "0")
    env = {"KAMADO_HEALTH_STALL_SECONDS": str(STALL_S), "KAMADO_SSE_HEARTBEAT_SECONDS": "0.5"}
    yield from start_server(smollm2_path, *args, env=env)


def chat_url(server) -> str:
    return server.url + "/v1/chat/completions"


def test_max_tokens_larger_than_the_context_is_clamped(tiny_server):
    raw = tiny_server.client().chat.completions.with_raw_response.create(
        model=tiny_server.model, messages=HI, max_tokens=4096, temperature=0
    )
    r = raw.parse()
    clamped = int(raw.headers["x-kamado-max-tokens-clamped"])
    assert clamped == 128 - r.usage.prompt_tokens
    assert r.usage.completion_tokens <= clamped
    assert r.choices[0].finish_reason in ("stop", "length")


def test_max_tokens_that_fits_is_not_clamped(tiny_server):
    r = httpx.post(chat_url(tiny_server), json={"messages": HI, "max_tokens": 2})
    assert r.status_code == 200 and "x-kamado-max-tokens-clamped" not in r.headers


def test_prompt_that_fills_the_context_is_refused(tiny_server):
    r = httpx.post(
        chat_url(tiny_server), json={"messages": [{"role": "user", "content": "a " * 200}]}
    )
    assert r.status_code == 400
    assert "128" in r.json()["error"]["message"]


def test_full_queue_answers_503_with_retry_after(tiny_server):
    body = {"messages": HI, "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", chat_url(tiny_server), json=body, timeout=60) as busy:
        assert busy.status_code == 200
        r = httpx.post(chat_url(tiny_server), json={"messages": HI, "max_tokens": 2})
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.APIStatusError) as e:
            tiny_server.client().chat.completions.create(model=tiny_server.model, messages=HI)
        assert e.value.status_code == 503
    deadline = time.monotonic() + 30
    while tiny_server.metric("kamado_requests_in_flight") and time.monotonic() < deadline:
        time.sleep(0.1)
    r = httpx.post(chat_url(tiny_server), json={"messages": HI, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_health_reports_a_stalled_engine_and_streams_keep_alive(tiny_server):
    pid = tiny_server.engine_pid()
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    os.kill(pid, signal.SIGSTOP)  # alive, but making no progress: a hung engine
    try:
        lines: list[str] = []

        def ask():
            body = {"messages": HI, "max_tokens": 2, "stream": True}
            with httpx.stream("POST", chat_url(tiny_server), json=body, timeout=120) as r:
                lines.extend(line for line in r.iter_lines() if line)

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(STALL_S + 1.5)
        h = httpx.get(tiny_server.url + "/health")
        assert h.status_code == 503
        assert h.json()["status"] == "engine_stalled"
    finally:
        os.kill(pid, signal.SIGCONT)
    t.join(120)
    assert lines[-1] == "data: [DONE]"
    # While nothing came, SSE comments kept the connection visibly alive.
    assert lines.count(": keep-alive") >= 3
    assert httpx.get(tiny_server.url + "/health").status_code == 200


def test_engine_death_mid_stream_ends_the_stream_and_the_engine_comes_back(tiny_server):
    old_pid = tiny_server.engine_pid()
    body = {"messages": HI, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", chat_url(tiny_server), json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break
        os.kill(old_pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    errors = [json.loads(line[6:]) for line in rest[:-1] if '"error"' in line]
    assert errors and errors[-1]["error"]["message"]
    # Unhealthy until the supervisor has a new engine up; meanwhile 503s, not 500s or hangs.
    deadline = time.monotonic() + 10
    while (h := httpx.get(tiny_server.url + "/health")).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert h.json()["status"] == "engine_dead"
    r = httpx.post(chat_url(tiny_server), json={"messages": HI, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 or r.json()["error"]["code"] == "engine_unavailable"
    deadline = time.monotonic() + 180
    while httpx.get(tiny_server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, tiny_server.log()
        time.sleep(0.5)
    r = httpx.post(chat_url(tiny_server), json={"messages": HI, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert tiny_server.engine_pid() != old_pid
    assert tiny_server.metric("kamado_engine_restarts_total") == 1


@pytest.fixture(scope="module")
def restarting_server(smollm2_path):
    env = {"KAMADO_HEALTH_STALL_SECONDS": "1", "KAMADO_ENGINE_RESTART_STALL_SECONDS": "2"}
    yield from start_server(smollm2_path, "--max-model-len", "128", env=env)


def test_hung_engine_is_replaced(restarting_server):
    server = restarting_server
    old_pid = server.engine_pid()
    os.kill(old_pid, signal.SIGSTOP)
    try:
        r = httpx.post(chat_url(server), json={"messages": HI, "max_tokens": 2}, timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_pid, signal.SIGCONT)
    # The request caught on the hung engine fails cleanly once the engine is replaced.
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_unavailable"
    deadline = time.monotonic() + 180
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.5)
    r = httpx.post(chat_url(server), json={"messages": HI, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert server.engine_pid() != old_pid
    assert server.metric("kamado_engine_restarts_total") == 1
