"""A real `kamado serve` (SmolLM2-135M) driven by the official openai client, sync and async."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kamado.models import ModelSource, load_tokenizer

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Write one sentence about the sea."}]


def greedy(server, messages=HI, **kw):
    return server.client().chat.completions.create(
        model=server.model,
        messages=messages,
        temperature=0,
        max_tokens=kw.pop("max_tokens", 8),
        **kw,
    )


def test_models_lists_the_served_model(smol_server):
    models = smol_server.client().models.list().data
    assert [m.id for m in models] == [smol_server.model]


def test_chat_non_streaming(smol_server):
    r = greedy(smol_server)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_non_streaming_and_reports_usage(smol_server):
    smol_server.client()
    expected = greedy(smol_server).choices[0].message.content
    chunks = list(greedy(smol_server, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_stream_ends_with_done(smol_server):
    body = {"messages": HI, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", smol_server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_completions_text_and_token_prompts(smol_server):
    client = smol_server.client()
    r = client.completions.create(
        model=smol_server.model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    ids = client.completions.create(
        model=smol_server.model, prompt=[504, 3575, 282, 4649, 314], max_tokens=3, temperature=0
    )
    assert ids.usage.prompt_tokens == 5 and ids.choices[0].text
    streamed = client.completions.create(
        model=smol_server.model,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_n_choices(smol_server):
    r = smol_server.client().chat.completions.create(
        model=smol_server.model, messages=HI, n=3, temperature=1.0, seed=7, max_tokens=5
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in r.choices)
    assert r.usage.completion_tokens == 15
    chunks = list(
        smol_server.client().chat.completions.create(
            model=smol_server.model,
            messages=HI,
            n=2,
            temperature=1.0,
            seed=7,
            max_tokens=4,
            stream=True,
        )
    )
    done = {
        c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason
    }
    assert done == {0: "length", 1: "length"}


def test_stop_string_cuts_text_and_reports_stop(smol_server):
    smol_server.client()
    full = greedy(smol_server, max_tokens=12).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]
    expected = full[: full.index(stop)]
    r = greedy(smol_server, max_tokens=12, stop=[stop, "never-appears"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    chunks = list(greedy(smol_server, max_tokens=12, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    both = greedy(smol_server, max_tokens=12, stop=stop, n=2)  # each choice stops on its own
    assert [c.message.content for c in both.choices] == [expected, expected]
    assert [c.finish_reason for c in both.choices] == ["stop", "stop"]


def test_seed_reproducible_at_temperature(smol_server):
    client = smol_server.client()

    def sample(seed):
        r = client.chat.completions.create(
            model=smol_server.model, messages=HI, temperature=1.0, seed=seed, max_tokens=6
        )
        return r.choices[0].message.content

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1  # the seed does change the sample


def test_chat_logprobs(smol_server):
    r = greedy(smol_server, max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)  # greedy


def test_streamed_logprobs_match(smol_server):
    whole = greedy(smol_server, max_tokens=4, logprobs=True, top_logprobs=2)
    chunks = list(greedy(smol_server, max_tokens=4, logprobs=True, top_logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in whole.choices[0].logprobs.content]


def test_completion_logprobs(smol_server):
    r = smol_server.client().completions.create(
        model=smol_server.model, prompt="1, 2, 3,", max_tokens=3, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0


def test_logit_bias_forces_and_bans_tokens(smol_server, smollm2_path):
    tokenizer = load_tokenizer(ModelSource("gguf", "smol", smollm2_path))
    client = smol_server.client()

    def complete(bias: dict[str, float]) -> str:
        return client.completions.create(
            model=smol_server.model, prompt="1, 2, 3,", max_tokens=3, temperature=0,
            logit_bias=bias,
        ).choices[0].text  # fmt: skip

    sea = tokenizer.encode(" sea", add_special_tokens=False)
    assert len(sea) == 1
    assert complete({str(sea[0]): 100}) == " sea" * 3
    free = complete({})
    first = tokenizer.encode(free, add_special_tokens=False)[0]
    banned = complete({str(first): -100})
    assert tokenizer.encode(banned, add_special_tokens=False)[0] != first


async def test_sixteen_concurrent_streams_match_their_solo_results(smol_server):
    prompts = [[{"role": "user", "content": f"Count from {i} to {i + 5}."}] for i in range(16)]
    client = smol_server.async_client()

    async def one(messages, stream):
        kw = dict(model=smol_server.model, messages=messages, temperature=0, max_tokens=4)
        if not stream:
            return (await client.chat.completions.create(**kw)).choices[0].message.content
        text = ""
        async for chunk in await client.chat.completions.create(**kw, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text

    solo = [await one(p, stream=False) for p in prompts]
    together = await asyncio.gather(*(one(p, stream=True) for p in prompts))
    assert list(together) == solo
    await client.close()


def test_health_and_metrics(smol_server):
    h = httpx.get(smol_server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = httpx.get(smol_server.url + "/metrics").text
    for name in (
        "kamado_num_requests_waiting",
        "kamado_num_requests_running",
        "kamado_kv_blocks_used",
        "kamado_kv_cache_usage_ratio",
        "kamado_prompt_tokens_total",
        "kamado_generation_tokens_total",
        "kamado_decode_steps_launched_ahead_total",
        "kamado_time_to_first_token_seconds_bucket",
        "kamado_inter_token_latency_seconds_bucket",
        "kamado_bare_json_tool_calls_total",
    ):
        assert name in text, name
    assert smol_server.metric("kamado_generation_tokens_total") > 0


def test_client_disconnect_frees_kv_blocks(smol_server):
    baseline = smol_server.metric("kamado_kv_blocks_used")
    body = {"messages": HI, "max_tokens": 400, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", smol_server.url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # generating: now walk away
        assert smol_server.metric("kamado_kv_blocks_used") > baseline
    for _ in range(100):
        if smol_server.metric("kamado_kv_blocks_used") == baseline:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert smol_server.metric("kamado_kv_blocks_used") == baseline
    assert smol_server.metric("kamado_requests_in_flight") == 0
    assert smol_server.metric("kamado_num_requests_running") == 0


def test_non_streaming_disconnect_frees_kv_blocks(smol_server):
    baseline = smol_server.metric("kamado_kv_blocks_used")
    body = {"messages": HI, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(smol_server.url + "/v1/chat/completions", json=body, timeout=1.5)
    for _ in range(100):
        if smol_server.metric("kamado_kv_blocks_used") == baseline:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert smol_server.metric("kamado_kv_blocks_used") == baseline
    assert smol_server.metric("kamado_requests_in_flight") == 0


def test_usage_json_shape(smol_server):
    r = httpx.post(
        smol_server.url + "/v1/chat/completions",
        json={"messages": HI, "max_tokens": 2},
        timeout=60,
    ).json()
    assert set(r["usage"]) == {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    assert isinstance(r["usage"]["prompt_tokens_details"]["cached_tokens"], int)
    json.dumps(r)
