"""Tool-call formats: detection from chat templates, grammars that accept each format's own
calls (and only calls whose arguments fit), and the server's parser reading them back."""

from __future__ import annotations

import json

import pytest

from kamado.models import load_tokenizer, resolve_model
from kamado.server.tool_calls import CallEvent, ToolCallParser
from kamado.structured.tool_formats import detect_tool_format, parse_xml_call
from kamado.structured.tool_grammar import tool_call_constraint

llguidance = pytest.importorskip("llguidance")

WRITE = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "content": {"type": "string"},
        "mode": {"type": "integer", "minimum": 0},
    },
    "required": ["path", "content"],
    "additionalProperties": False,
}
TOOLS = {"write_file": WRITE, "list_dir": None}
CODE = "if a < b:\n    print('</p>', {\"k\": 1})"

CALLS = {
    "hermes": '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "content": '
    + json.dumps(CODE)
    + ', "mode": 420}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
    f"<parameter=content>\n{CODE}\n</parameter>\n<parameter=mode>\n420\n</parameter>\n"
    "</function>\n</tool_call>",
    "llama3_json": '{"name": "write_file", "parameters": {"path": "a.py", "content": '
    + json.dumps(CODE)
    + ', "mode": 420}}',
}
BAD_ARGUMENTS = {
    "hermes": CALLS["hermes"].replace("420", '"rw"'),
    "qwen3_coder": CALLS["qwen3_coder"].replace("420", "-1"),
    "llama3_json": CALLS["llama3_json"].replace('"path": "a.py", ', ""),
}


@pytest.fixture(scope="module")
def tokenizers(qwen05_path):
    import llguidance.hf

    tok = load_tokenizer(resolve_model(str(qwen05_path)))
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))


def accepts(tokenizers, fmt: str, text: str, parallel: bool = False) -> bool:
    tok, llt = tokenizers
    constraint = tool_call_constraint(TOOLS, fmt, True, parallel)
    matcher = llguidance.LLMatcher(llt, constraint.grammar(), log_level=0)
    return matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()


def test_format_is_read_from_the_template(qwen05_path):
    qwen = load_tokenizer(resolve_model(str(qwen05_path))).chat_template
    assert detect_tool_format(qwen) == "hermes"
    assert detect_tool_format("{{ messages }}") == "hermes"  # no tools: kamado's preamble
    coder = "{% if tools %}<tool_call>\n<function={{ name }}>\n<parameter=...{% endif %}"
    assert detect_tool_format(coder) == "qwen3_coder"
    llama = '{% if tools %}{"name": function name, "parameters": ...}<|python_tag|>{% endif %}'
    assert detect_tool_format(llama) == "llama3_json"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_grammar_accepts_the_formats_own_calls_and_the_parser_reads_them(tokenizers, fmt):
    assert accepts(tokenizers, fmt, CALLS[fmt])
    assert not accepts(tokenizers, fmt, BAD_ARGUMENTS[fmt])
    parser = ToolCallParser(TOOLS, bare_json=False, fmt=fmt)
    events = []
    for i in range(0, len(CALLS[fmt]), 3):  # streamed in small pieces
        events += parser.feed(CALLS[fmt][i : i + 3])
    events += parser.finish()
    (call,) = events
    assert isinstance(call, CallEvent) and call.name == "write_file" and not call.bare
    assert json.loads(call.arguments) == {"path": "a.py", "content": CODE, "mode": 420}


@pytest.mark.slow
def test_parallel_calls_only_where_allowed(tokenizers):
    two = CALLS["hermes"] + "\n" + CALLS["hermes"]
    assert accepts(tokenizers, "hermes", two, parallel=True)
    assert not accepts(tokenizers, "hermes", two, parallel=False)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("parallel", [True, False])
def test_the_calls_line_may_end_before_the_reply_does(tokenizers, fmt, parallel):
    # The newline a model writes after its last call must not commit it to another call.
    assert accepts(tokenizers, fmt, CALLS[fmt] + "\n", parallel)
    assert not accepts(tokenizers, fmt, CALLS[fmt] + "\n\n", parallel)


def test_xml_body_with_text_between_parameters_is_not_a_call():
    body = "\n<function=write_file>\n<parameter=path>\na\n</parameter>\nhmm\n</function>\n"
    assert parse_xml_call(body, TOOLS) is None
    assert parse_xml_call(body.replace("hmm\n", ""), TOOLS) == ("write_file", {"path": "a"})


@pytest.mark.slow
def test_text_or_valid_calls_under_auto_with_strict_tools(tokenizers):
    tok, llt = tokenizers
    constraint = tool_call_constraint(TOOLS, "hermes", True, True, or_text=True)

    def ok(text: str) -> bool:
        matcher = llguidance.LLMatcher(llt, constraint.grammar(), log_level=0)
        return matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()

    assert ok("Nothing to do: the file is {already} <b>fine</b>.")
    assert ok("Writing it now.\n" + CALLS["hermes"])
    assert not ok("Writing it now.\n" + BAD_ARGUMENTS["hermes"])
