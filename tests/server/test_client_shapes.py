"""Request shapes real agents send (shared/CLIENTS.md), replayed against SmolLM2, whose template
knows nothing of tools: they must still be served, never a 500 or an empty stream."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.slow

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def stream_events(server, body) -> tuple[httpx.Headers, list]:
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        headers = r.headers
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("error" not in c for c in chunks)
    return headers, chunks


def test_aider_shaped_streamed_conversation(smol_server):
    messages = [{"role": "system", "content": "Act as an expert software developer."}]
    for i in range(4):
        messages += [
            {"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
            {"role": "assistant", "content": f"{i} + {i} = {2 * i}."},
        ]
    messages.append({"role": "user", "content": "And 5 + 5?"})
    _, chunks = stream_events(
        smol_server,
        {"model": smol_server.model, "messages": messages, "stream": True, "max_tokens": 4},
    )
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text


def test_tool_history_with_null_content_parts_and_tool_role(smol_server):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You are an agent."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is in a.txt?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "cat a.txt"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "hello from a.txt"},
    ]
    body = {"messages": messages, "tools": [BASH], "max_tokens": 4, "temperature": 0}
    r = httpx.post(smol_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] is not None or message["tool_calls"]
    # The model saw the tools (our preamble), its own call and the tool result.
    assert r.json()["usage"]["prompt_tokens"] > 150


def test_streamed_usage_and_clamped_max_tokens(smol_server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4096,
        "temperature": 0,
        "stop": ["\n"],
    }
    headers, chunks = stream_events(smol_server, body)
    usage = chunks[-1]["usage"]
    assert int(headers["x-kamado-max-tokens-clamped"]) == 512 - usage["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_paths_without_v1_prefix(smol_server):
    r = httpx.get(smol_server.url + "/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == smol_server.model


def test_kamado_chat_terminal_client(smol_server):
    out = subprocess.run(
        [sys.executable, "-m", "kamado.cli", "chat", "--url", smol_server.url + "/v1"]
        + ["--max-tokens", "4", "--temperature", "0"],
        input="hello\n/reset\n/exit\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"kamado chat with {smol_server.model}" in out.stdout
    assert "(conversation cleared)" in out.stdout
