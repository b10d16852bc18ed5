"""The prefix cache seen through the API: cached_tokens in usage (openai client), metrics,
session keys, and the disk tier surviving a server restart."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import Server, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def server(smollm2_path, disk_dir) -> Iterator[Server]:
    args = ("--max-model-len", "1024", "--dtype", "float32", "--kv-disk-dir", str(disk_dir))
    yield from start_server(smollm2_path, *args)


def conversation() -> list[dict]:
    # A fresh system prompt per test: nothing cached from another test can match it.
    system = f"You are a careful assistant, session {uuid.uuid4().hex}. " * 6
    return [{"role": "system", "content": system}, {"role": "user", "content": "List 3 colors."}]


def chat(server: Server, messages: list[dict], **kw):
    return server.client().chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=12, **kw
    )


def metric(server: Server, line_start: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(line_start)


def test_a_follow_up_turn_reports_its_cached_prefix(server):
    messages = conversation()
    first = chat(server, messages, extra_body={"prompt_cache_key": "agent-1"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now 3 animals."},
    ]
    second = chat(server, messages, extra_body={"prompt_cache_key": "agent-1"})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 16 < cached < second.usage.prompt_tokens


def test_the_same_request_again_gives_the_same_greedy_reply_from_the_cache(server):
    messages = conversation()
    cold = chat(server, messages, user="someone")
    warm = chat(server, messages, user="someone")
    # All but the last prompt token (whose logits are needed), partly filled block included.
    assert warm.usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens - 1
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_streaming_usage_reports_cached_tokens(server):
    messages = conversation()
    chat(server, messages)
    chunks = list(chat(server, messages, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions_report_cached_tokens(server):
    prompt = conversation()[0]["content"]
    client = server.client()
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=4)
    again = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in again if c.usage is not None][-1]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_metrics_count_queried_and_hit_tokens(server):
    messages = conversation()
    chat(server, messages)
    before = metric(server, 'kamado_prefix_cache_hit_tokens_total{tier="device"}')
    chat(server, messages)
    after = metric(server, 'kamado_prefix_cache_hit_tokens_total{tier="device"}')
    assert after > before
    assert 0 < metric(server, "kamado_prefix_cache_partial_hit_tokens_total") <= after
    assert metric(server, "kamado_prefix_cache_queried_tokens_total") >= after
    assert 0 < metric(server, 'kamado_prefix_cache_hit_rate{tier="device"}') <= 1
    assert metric(server, 'kamado_kv_tier_bytes_total{destination="disk"') >= 0


def test_a_turn_that_rewrites_history_is_counted_and_an_appended_one_is_not(server):
    messages = conversation()
    messages[1]["content"] = "Summarise this: " + "a long story about the sea. " * 12
    key = {"prompt_cache_key": f"agent-{uuid.uuid4().hex}"}
    first = chat(server, messages, extra_body=key)
    rewrites = metric(server, "kamado_prefix_history_rewrites_total")
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Shorter, please."},
    ]
    chat(server, messages, extra_body=key)
    assert metric(server, "kamado_prefix_history_rewrites_total") == rewrites
    # The client edits its first message: from there on the old history no longer matches.
    messages[1]["content"] = messages[1]["content"].replace("story", "tale", 6)
    chat(server, messages, extra_body=key)
    assert metric(server, "kamado_prefix_history_rewrites_total") == rewrites + 1
    assert metric(server, "kamado_prefix_history_rewritten_tokens_total") >= 32


def test_a_restarted_server_finds_evicted_blocks_on_disk(smollm2_path, tmp_path):
    # A small KV pool: the second conversation pushes the first one out of the device.
    args = ("--max-model-len", "384", "--dtype", "float32", "--kv-cache-gb", "0.02")
    args += ("--kv-disk-dir", str(tmp_path))
    first, other = conversation(), conversation()
    for s in start_server(smollm2_path, *args):
        reply = chat(s, first).choices[0].message.content
        chat(s, other)
        assert metric(s, 'kamado_kv_tier_bytes_total{destination="disk"') > 0
    for s in start_server(smollm2_path, *args):
        again = chat(s, first)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert again.choices[0].message.content == reply
        assert metric(s, 'kamado_prefix_cache_hit_tokens_total{tier="disk"}') > 0


def test_replaying_a_generated_trace_hits_the_cache(server, tmp_path):
    import asyncio

    from kamado.bench.replay import replay
    from kamado.bench.trace import generate_trace, read_trace, write_trace

    trace = tmp_path / "trace.jsonl"
    write_trace(trace, generate_trace(2, 900, 80, max_tokens=4, think_s=0.0, seed=1))
    turns = read_trace(trace)
    assert {t.agent for t in turns} == {"agent-0", "agent-1"} and len(turns) >= 6
    summary = asyncio.run(replay(server.url + "/v1", turns))
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["turns"] == len(turns)
    assert summary["prefix_hit_rate_follow_ups"] > 0.7
    assert summary["ttft_follow_ups"]["median_s"] > 0
