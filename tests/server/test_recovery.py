"""Faults under load: the engine killed, frozen, or failing inside a step while a reply
streams. Each time the supervisor brings up a new engine and the reply goes on from the
tokens already sent: the client gets the same text it would have got, with no error."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, start_server

pytestmark = pytest.mark.slow

# Long enough that a slow step on a busy CI machine is not taken for a hang.
RESTART_AFTER_S = 6

ASK = {
    "messages": [{"role": "user", "content": "Count from one to twenty in words."}],
    "max_tokens": 40,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults") / "fail-next-step"


@pytest.fixture(scope="module")
def server(smollm2_path, fault_file):
    env = {
        "KAMADO_HEALTH_STALL_SECONDS": "1",
        "KAMADO_ENGINE_RESTART_STALL_SECONDS": str(RESTART_AFTER_S),
        "KAMADO_SSE_HEARTBEAT_SECONDS": "0.5",
        "KAMADO_FAULT_FILE": str(fault_file),
    }
    # float32: a continuation recomputes the kept tokens, and must pick the same next ones.
    yield from start_server(smollm2_path, "--max-model-len", "256", "--dtype", "float32", env=env)


@pytest.fixture(scope="module")
def expected(server) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", json=ASK, timeout=120)
    return r.json()["choices"][0]["message"]["content"]


def stream_with_fault(server: Server, fault: Callable[[], None]) -> tuple[str, list[str]]:
    """Stream ASK, cause `fault` after the first words; return the text and any errors."""
    text, errors = "", []
    body = {**ASK, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        faulted = False
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"]["message"])
                continue
            text += event["choices"][0]["delta"].get("content") or ""
            if text and not faulted:
                fault()
                faulted = True
    return text, errors


def wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + 180
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)


def recoveries(server: Server) -> float:
    return server.metric("kamado_engine_recovery_seconds_count")


def test_killed_engine_mid_stream(server, expected):
    old_pid, before = server.engine_pid(), recoveries(server)
    text, errors = stream_with_fault(server, lambda: os.kill(old_pid, signal.SIGKILL))
    assert (text, errors) == (expected, [])
    assert server.engine_pid() != old_pid
    assert recoveries(server) == before + 1
    assert server.metric("kamado_requests_resumed_total") >= 1


def test_frozen_engine_is_replaced_past_its_deadline(server, expected):
    old_pid, before = server.engine_pid(), recoveries(server)
    statuses: list[str] = []

    def freeze() -> None:
        os.kill(old_pid, signal.SIGSTOP)

        def watch() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (h := httpx.get(server.url + "/health")):
                statuses.append(h.json()["status"])
                if h.status_code == 200 and set(statuses) != {"ok"}:
                    return  # healthy again after the trouble
                time.sleep(0.1)

        threading.Thread(target=watch, daemon=True).start()

    try:
        text, errors = stream_with_fault(server, freeze)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_pid, signal.SIGCONT)
    assert (text, errors) == (expected, [])
    # /health said what was going on: stalled, then recovering, then fine again.
    assert "engine_stalled" in statuses and "recovering" in statuses
    assert recoveries(server) == before + 1
    # A frozen engine is down from its last step: recovery counts the stall too.
    assert server.metric("kamado_engine_recovery_seconds_sum") >= RESTART_AFTER_S


def test_exception_inside_a_step(server, expected, fault_file):
    old_pid, before = server.engine_pid(), recoveries(server)
    text, errors = stream_with_fault(server, fault_file.touch)
    assert (text, errors) == (expected, [])
    assert not fault_file.exists()  # the engine did meet the fault
    assert server.engine_pid() != old_pid
    assert recoveries(server) == before + 1


def test_a_request_that_keeps_killing_the_engine_ends_with_an_error(server, fault_file):
    stop = threading.Event()

    def keep_faulting() -> None:
        while not stop.is_set():
            fault_file.touch()
            time.sleep(0.05)

    threading.Thread(target=keep_faulting, daemon=True).start()
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=ASK, timeout=300)
    finally:
        stop.set()
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "generation_failed"
    assert "failed 3 times" in r.json()["error"]["message"]
    fault_file.unlink(missing_ok=True)
    wait_healthy(server)
    r = httpx.post(server.url + "/v1/chat/completions", json={**ASK, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
