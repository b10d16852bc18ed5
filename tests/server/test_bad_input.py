"""Every kind of bad request gets an OpenAI-format 4xx that says what to fix; never a 500."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]


def post(server, body, path="/v1/chat/completions", **kw) -> httpx.Response:
    if isinstance(body, bytes | str):
        kw["content"] = body
        kw.setdefault("headers", {"content-type": "application/json"})
    else:
        kw["json"] = body
    return httpx.post(server.url + path, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for word in words:
        assert word.lower() in err["message"].lower(), err["message"]
    return err


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b'{"messages": [', ["not valid JSON", "line 1"]),
        (b"", ["empty"]),
        (b"[1, 2]", ["JSON object"]),
        ('{"messages": [{"role": "user", "content": "\xff"}]}'.encode("latin-1"), ["UTF-8"]),
    ],
)
def test_malformed_bodies(smol_server, body, words):
    assert_error(post(smol_server, body), 400, *words)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": "hi"}, "messages", ["messages"]),
        ({}, "messages", ["messages", "field required"]),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", ["role"]),
        ({"messages": [{"content": "x"}]}, "messages[0].role", ["role"]),
        ({"messages": HI, "temperature": "hot"}, "temperature", ["temperature"]),
        ({"messages": HI, "max_tokens": "lots"}, "max_tokens", ["max_tokens"]),
        ({"messages": HI, "stop": 5}, "stop", ["stop"]),
        ({"messages": HI, "tools": [{"type": "function"}]}, "tools[0].function", ["function"]),
        ({"messages": HI, "tool_choice": "sometimes"}, "tool_choice", ["tool_choice"]),
        ({"messages": HI, "chat_template_kwargs": [1]}, "chat_template_kwargs", ["dict"]),
        (
            {"messages": HI, "chat_template_kwargs": {"tools": []}},
            "chat_template_kwargs",
            ["may not set tools"],
        ),
    ],
)
def test_wrong_types_name_the_field(smol_server, body, param, words):
    err = assert_error(post(smol_server, body), 400, *words)
    assert err["param"] == param


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"temperature": 5}, ["temperature", "between 0 and 2"]),
        ({"top_p": 0}, ["top_p"]),
        ({"n": 0}, ["n must be"]),
        ({"n": 100}, ["n must be"]),
        ({"max_tokens": 0}, ["max_tokens"]),
        ({"max_completion_tokens": -3}, ["max_tokens"]),
        ({"presence_penalty": 9}, ["presence_penalty"]),
        ({"logprobs": True, "top_logprobs": 50}, ["top_logprobs"]),
        ({"top_logprobs": 2}, ["logprobs"]),
        ({"top_k": -5}, ["top_k"]),
        ({"repetition_penalty": 0}, ["repetition_penalty"]),
        ({"tool_choice": "required"}, ["tools"]),
        ({"response_format": {"type": "xml"}}, ["response_format", "xml"]),
        ({"logit_bias": {"5": 101}}, ["logit_bias", "between -100 and 100"]),
        ({"logit_bias": {"sea": 1}}, ["logit_bias", "token ids", "sea"]),
        ({"logit_bias": {"99999999": 1}}, ["logit_bias", "token ids"]),
        ({"logit_bias": {"-3": 1}}, ["logit_bias", "token ids"]),
    ],
)
def test_out_of_range_parameters(smol_server, extra, words):
    assert_error(post(smol_server, {"messages": HI, **extra}), 400, *words)


def test_empty_messages(smol_server):
    assert_error(post(smol_server, {"messages": []}), 400, "at least one message")


def test_unknown_model_is_404(smol_server):
    err = assert_error(post(smol_server, {"model": "gpt-9", "messages": HI}), 404, "gpt-9")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        smol_server.client().chat.completions.create(model="gpt-9", messages=HI)


def test_prompt_longer_than_context_names_the_limit(smol_server):
    long = [{"role": "user", "content": "word " * 2000}]
    err = assert_error(post(smol_server, {"messages": long}), 400, "512", "max_model_len")
    assert err["code"] == "context_length_exceeded"
    r = post(smol_server, {"prompt": "word " * 2000}, path="/v1/completions")
    assert_error(r, 400, "context")
    with pytest.raises(openai.BadRequestError):
        smol_server.client().chat.completions.create(
            model=smol_server.model, messages=long, stream=True
        )


def test_bad_completion_prompts(smol_server):
    assert_error(post(smol_server, {"prompt": ""}, path="/v1/completions"), 400, "empty")
    assert_error(post(smol_server, {"prompt": [1, -4]}, path="/v1/completions"), 400, "vocabulary")
    assert_error(post(smol_server, {"prompt": [10**9]}, path="/v1/completions"), 400, "vocabulary")
    assert_error(post(smol_server, {"prompt": ["a", "b"]}, path="/v1/completions"), 400, "batch")
    assert_error(post(smol_server, {"prompt": 5}, path="/v1/completions"), 400, "prompt")


def test_non_text_content_part(smol_server):
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(smol_server, {"messages": msg}), 400, "image_url")


def test_unknown_route_and_method_are_json(smol_server):
    r = httpx.get(smol_server.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(smol_server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client_raises_bad_request(smol_server):
    with pytest.raises(openai.BadRequestError) as e:
        smol_server.client().chat.completions.create(
            model=smol_server.model, messages=HI, temperature=3
        )
    assert "temperature" in str(e.value)


def test_server_still_serves_after_bad_input(smol_server):
    r = post(smol_server, {"messages": HI, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
