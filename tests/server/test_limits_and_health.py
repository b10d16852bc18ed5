"""Context clamping, the bounded queue, and /health that notices a stalled or dead engine.

Runs its own small server (128-token context, one sequence, no queue). Faults that make the
supervisor replace the engine are in test_recovery.py.
"""

from __future__ import annotations

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


@pytest.mark.parametrize(
    ("value", "words"),
    [("{not json", "not JSON"), ("[1]", "JSON object"), ('{"tokenize": true}', "tokenize")],
)
def test_bad_chat_template_kwargs_stop_the_server_before_loading(value, words, capsys):
    from kamado.cli import main

    args = ["serve", "--model", "nowhere.gguf", "--listen", "127.0.0.1:0"]
    assert main([*args, "--chat-template-kwargs", value]) == 2
    assert words in capsys.readouterr().err
