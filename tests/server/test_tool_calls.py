"""Tool-call parsing: tagged and bare-JSON calls, streamed in any chunking, nothing lost."""

from __future__ import annotations

import json

import pytest

from kamado.server.json_schema import schema_errors
from kamado.server.tool_calls import (
    ArgumentsEvent,
    CallEvent,
    CallStartEvent,
    TextEvent,
    ToolCallParser,
)

BASH = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
    "required": ["command"],
}
TOOLS = {"bash": BASH, "read": {"type": "object", "properties": {"path": {"type": "string"}}}}


def run(text: str, chunk: int | None = None, bare: bool = True):
    parser = ToolCallParser(TOOLS, bare_json=bare)
    events = []
    pieces = [text] if chunk is None else [text[i : i + chunk] for i in range(0, len(text), chunk)]
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, TextEvent))
    calls = [(e.name, json.loads(e.arguments), e.bare) for e in events if isinstance(e, CallEvent)]
    return content, calls


CHUNKINGS = [None, 1, 2, 3, 7]


@pytest.mark.parametrize("chunk", CHUNKINGS)
def test_tagged_call_becomes_a_call(chunk):
    text = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    assert run(text, chunk) == ("", [("bash", {"command": "ls -la"}, False)])


@pytest.mark.parametrize("chunk", CHUNKINGS)
def test_text_then_two_tagged_calls(chunk):
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}\n</tool_call>'
    )
    content, calls = run(text, chunk)
    assert content == "Let me look.\n"
    assert calls == [("read", {"path": "a.py"}, False), ("bash", {"command": "pwd"}, False)]


@pytest.mark.parametrize("chunk", CHUNKINGS)
def test_plain_text_passes_through_unchanged(chunk):
    text = (
        "Use `ls` to list files; a <tool> tag and {braces} stay text.\n```python\nx = {1: 2}\n```"
    )
    assert run(text, chunk) == (text, [])


@pytest.mark.parametrize("chunk", CHUNKINGS)
def test_bare_json_call_under_auto(chunk):
    text = '{"name": "bash", "arguments": {"command": "cat x"}}'
    assert run(text, chunk) == ("", [("bash", {"command": "cat x"}, True)])


@pytest.mark.parametrize("chunk", CHUNKINGS)
def test_fenced_json_call(chunk):
    text = '```json\n{"name": "bash", "arguments": {"command": "make test"}}\n```\n'
    assert run(text, chunk) == ("", [("bash", {"command": "make test"}, True)])


# Qwen2.5's template lists tools as {"type": "function", "function": {...}}, and its 1.5B
# model answered OpenCode with a call in that shape (fenced, as here): it must act.
OPENAI_SHAPED = (
    '```json\n{\n  "type": "function",\n  "function": {\n    "name": "bash",\n'
    '    "arguments": {\n      "command": "pytest", "timeout": 120000\n    }\n  }\n}\n```'
)


@pytest.mark.parametrize("chunk", CHUNKINGS)
def test_call_in_openais_tool_shape(chunk):
    assert run(OPENAI_SHAPED, chunk) == (
        "",
        [("bash", {"command": "pytest", "timeout": 120000}, True)],
    )
    inner = '{"type": "function", "function": {"name": "read", "arguments": {}}}'
    tagged = f"<tool_call>\n{inner}\n</tool_call>"
    assert run(tagged, chunk) == ("", [("read", {}, False)])


@pytest.mark.parametrize("chunk", [None, 1])
def test_optional_argument_given_as_null_is_left_out(chunk):
    # The 1.5B model answered OpenCode with {"pattern": "*", "path": null} for glob.
    bare = '```json\n{"name": "read", "arguments": {"path": null}}\n```'
    assert run(bare, chunk) == ("", [("read", {}, True)])
    tagged = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls", "timeout": null}}'
    assert run(tagged + "\n</tool_call>", chunk) == ("", [("bash", {"command": "ls"}, False)])


def test_null_stays_where_the_schema_allows_it():
    schema = {"type": "object", "properties": {"path": {"type": ["string", "null"]}}}
    parser = ToolCallParser({"read": schema})
    events = parser.feed('{"name": "read", "arguments": {"path": null}}') + parser.finish()
    assert [(e.name, json.loads(e.arguments)) for e in events] == [("read", {"path": None})]
    # Nor is it dropped from a tagged call that fails its schema for another reason.
    schema["properties"]["line"] = {"type": "integer"}
    parser = ToolCallParser({"read": schema})
    text = '<tool_call>\n{"name": "read", "arguments": {"path": null, "line": "x"}}\n</tool_call>'
    events = parser.feed(text) + parser.finish()
    assert [json.loads(e.arguments) for e in events] == [{"path": None, "line": "x"}]


READ_A = '{"name": "read", "arguments": {"path": "a.py"}}'
BASH_LS = '{"name": "bash", "arguments": {"command": "ls"}}'
SEVERAL_CALLS = [
    f"{READ_A}\n{BASH_LS}",
    f"```json\n{READ_A},\n{BASH_LS}\n```",
    f"[{READ_A}, {BASH_LS}]",
]


@pytest.mark.parametrize("text", SEVERAL_CALLS)
@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_a_reply_of_several_json_calls_is_several_calls(text, chunk):
    expected = [("read", {"path": "a.py"}, True), ("bash", {"command": "ls"}, True)]
    assert run(text, chunk) == ("", expected)


def test_bare_json_switched_off_is_text():
    text = '{"name": "bash", "arguments": {"command": "cat x"}}'
    assert run(text, bare=False) == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "rm_rf", "arguments": {"command": "x"}}',  # undeclared tool
        '{"name": "bash", "arguments": {"timeout": 3}}',  # misses a required argument
        '{"name": "bash", "arguments": {"command": 5}}',  # wrong type
        '{"name": "bash"}',  # no arguments at all
        # several calls, one of them to an undeclared tool (as the 1.5B model wrote)
        '{"name": "read", "arguments": {"path": "a"}}\n{"name": "shell", "arguments": {}}',
        '[{"name": "read", "arguments": {"path": "a"}}] and more',
        "[1, 2, 3]",
        "[]",
        '{"name": "bash", "arguments": {"command": null}}',  # a required argument as null
        '{"type": "function", "function": {"name": "bash", "arguments": {"timeout": 3}}}',
        '{"type": "tool", "function": {"name": "bash", "arguments": {"command": "ls"}}}',
        '{"name": "bash", "arguments": {"command": "ls"}} and then some words',
        'Here: {"name": "bash", "arguments": {"command": "ls"}}',
        '```json\n{"name": "bash", "arguments": {"command": "ls"}}\n```\nThat runs ls.',
        '```python\n{"name": "bash", "arguments": {"command": "ls"}}\n```',
        '{"name": "bash", "arguments": {"command": "ls"',  # cut off
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
        "<tool_call>\nnot json at all\n</tool_call>",
    ],
)
@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_what_is_not_a_valid_call_is_kept_as_text(text, chunk):
    content, calls = run(text, chunk)
    assert calls == []
    assert content == text


def test_unclosed_tag_at_end_still_parses():
    text = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}'
    assert run(text, 4) == ("", [("bash", {"command": "ls"}, False)])


def test_text_is_released_before_the_reply_ends():
    parser = ToolCallParser(TOOLS)
    out = parser.feed("Hello there, I will now ")
    assert "".join(e.text for e in out) == "Hello there, I will now "
    assert parser.feed("<tool_") == []  # might be a tag: held


def test_bare_json_decided_early_when_it_cannot_be_a_call():
    parser = ToolCallParser(TOOLS)
    assert parser.feed('{"a": 1}') == []  # could still be a lone object
    out = parser.feed(" is a dict")
    assert "".join(e.text for e in out) == '{"a": 1} is a dict'
    parser = ToolCallParser(TOOLS)
    assert "".join(e.text for e in parser.feed("[link](x)")) == "[link](x)"


def test_schema_checker_basics():
    assert schema_errors({"command": "x"}, BASH) == []
    assert schema_errors({"command": "x", "timeout": 1.0}, BASH) == []
    assert schema_errors({"command": "x", "timeout": True}, BASH)
    strict = {**BASH, "additionalProperties": False}
    assert schema_errors({"command": "x", "other": 1}, strict)
    assert schema_errors("s", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == []
    assert schema_errors(["a", 1], {"type": "array", "items": {"type": "string"}})
    assert schema_errors("b", {"enum": ["a"]})


@pytest.mark.parametrize("chunk", [None, 2])
def test_call_one_brace_short_at_the_end_is_repaired(chunk):
    content, calls = run('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}', chunk)
    assert (content, calls) == ("", [("bash", {"command": "ls"}, False)])


def test_repair_needs_a_schema_valid_call():
    text = '<tool_call>\n{"name": "bash", "arguments": {"timeout": 1}'
    assert run(text) == (text, [])


def test_forced_calls_stream_name_first_then_argument_fragments():
    text = (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la", "timeout": 5}}\n'
        '</tool_call>\n<tool_call>\n{"name": "read", "arguments": {"path": "a"}}\n</tool_call>'
    )
    parser = ToolCallParser(TOOLS, bare_json=True, stream_arguments=True)
    events = []
    for i in range(0, len(text), 4):
        events += parser.feed(text[i : i + 4])
    events += parser.finish()
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "CallStartEvent" and kinds.count("CallStartEvent") == 2
    first_args = events[1 : kinds.index("CallEvent")]
    assert len(first_args) > 3 and all(isinstance(e, ArgumentsEvent) for e in first_args)
    assert json.loads("".join(e.text for e in first_args)) == {"command": "ls -la", "timeout": 5}
    calls = [e for e in events if isinstance(e, CallEvent)]
    assert [c.name for c in calls] == ["bash", "read"] and all(c.streamed for c in calls)
    assert not [e for e in events if isinstance(e, TextEvent)]


def test_streamed_call_cut_short_is_not_repeated_as_text():
    parser = ToolCallParser(TOOLS, bare_json=True, stream_arguments=True)
    events = parser.feed('<tool_call>\n{"name": "bash", "arguments": {"command": "l')
    events += parser.finish()
    assert isinstance(events[0], CallStartEvent)
    assert "".join(e.text for e in events[1:]) == '{"command": "l'
    assert all(isinstance(e, ArgumentsEvent) for e in events[1:])
