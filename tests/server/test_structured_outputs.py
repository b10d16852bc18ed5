"""response_format and the guided_* extra fields against a real server (Qwen2.5-Coder 0.5B):
replies validate, streamed JSON equals the whole reply, bad constraints are 400s naming the part."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"enum": ["python", "rust", "go"]}, "maxItems": 2},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe Ada, a 36 year old programmer, as JSON."}]


def json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}


def chat(server, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 60)
    return server.client().chat.completions.create(model=server.model, temperature=0, **kw)


def post(server, body):
    return httpx.post(
        server.url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=60
    )


def test_json_schema_reply_validates(qwen_server):
    r = chat(qwen_server, response_format=json_schema_format(PERSON))
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_reply_is_an_object(qwen_server):
    r = chat(qwen_server, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_streamed_json_equals_the_whole_reply(qwen_server):
    whole = chat(qwen_server, response_format=json_schema_format(PERSON))
    stream = chat(qwen_server, response_format=json_schema_format(PERSON), stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 3  # streamed as generated, not in one piece
    assert "".join(pieces) == whole.choices[0].message.content


def test_guided_regex_and_grammar(qwen_server):
    r = chat(qwen_server, extra_body={"guided_regex": "(yes|no), [a-z ]{1,20}"})
    assert re.fullmatch("(yes|no), [a-z ]{1,20}", r.choices[0].message.content)
    grammar = 'start: "def " NAME "(" ")" ":"\nNAME: /[a-z_]{1,12}/'
    r = chat(qwen_server, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"def [a-z_]{1,12}\(\):", r.choices[0].message.content)


def test_completions_endpoint_takes_guided_regex(qwen_server):
    r = qwen_server.client().completions.create(
        model=qwen_server.model,
        prompt="The answer is",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_regex": " [0-9]{1,3}"},
    )
    assert re.fullmatch(" [0-9]{1,3}", r.choices[0].text)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": json_schema_format({"type": "objekt"})},
            "response_format.json_schema.schema",
            ["objekt"],
        ),
        (
            {"response_format": json_schema_format({"$ref": "#/$defs/nowhere"})},
            "response_format.json_schema.schema",
            ["nowhere"],
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            ["schema"],
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex", ["unclosed"]),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar", ["missing_rule"]),
        ({"guided_regex": "a" * 300_000}, "guided_regex", ["limit"]),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            ["not both"],
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "ok", "parameters": {}}},
                    {
                        "type": "function",
                        "function": {"name": "bad", "parameters": {"type": "objekt"}},
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
            ["objekt"],
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_part(qwen_server, body, param, words):
    r = post(qwen_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    for word in words:
        assert word in err["message"]
