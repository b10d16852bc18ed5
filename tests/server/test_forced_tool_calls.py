"""tool_choice required / named constrain decoding: every call parses and its arguments validate
(jsonschema), streamed calls reassemble to the same calls, and a small agent runs several turns
through the official openai client with no parse failure (Qwen2.5-Coder 0.5B)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator

import jsonschema
import pytest

from tests.server.conftest import Server, start_server

pytestmark = pytest.mark.slow


def fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


READ = fn("read_file", "Read a file", {"path": {"type": "string"}}, ["path"])
WRITE = fn(
    "write_file",
    "Write text to a file",
    {"path": {"type": "string"}, "content": {"type": "string"}},
    ["path", "content"],
)
RUN_TESTS = fn(
    "run_tests",
    "Run the test suite",
    {"verbose": {"type": "boolean"}, "pattern": {"type": "string", "maxLength": 30}},
    ["verbose"],
)
TOOLS = [READ, WRITE, RUN_TESTS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "Show me what is in README.md.",
    "Create hello.py that prints hello.",
    "Run the tests.",
    "Does setup.cfg exist? Look at it.",
    "Fix the bug in util.py.",
    "Check that everything passes, verbosely.",
]


@pytest.fixture(scope="module")
def server(qwen05_path) -> Iterator[Server]:
    # Room for a few agent turns: three tool schemas and the history fill ~1k tokens.
    yield from start_server(qwen05_path, "--max-model-len", "2048")


def valid_calls(message, names=tuple(SCHEMAS)) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls or []:
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        calls.append((call.function.name, args))
    return calls


async def ask_all(server: Server, tool_choice, prompts=PROMPTS, tools=TOOLS, **kw) -> list:
    client = server.async_client()
    try:
        replies = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=server.model,
                    messages=[{"role": "user", "content": p}],
                    tools=tools,
                    tool_choice=tool_choice,
                    temperature=0,
                    max_tokens=80,
                    **kw,
                )
                for p in prompts
            )
        )
    finally:
        await client.close()
    return [r.choices[0] for r in replies]


async def test_required_calls_always_parse_and_validate(server):
    for choice in await ask_all(server, "required", parallel_tool_calls=False):
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        assert len(valid_calls(choice.message)) == 1


async def test_required_calls_end_the_turn_when_several_are_allowed(server):
    # The newline after the last call once led this model into call after call until
    # max_tokens.
    for choice in await ask_all(server, "required"):
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        assert valid_calls(choice.message)


async def test_logprobs_of_a_forced_reply_list_only_tokens_it_may_take(server):
    (choice,) = await ask_all(server, "required", PROMPTS[:1], logprobs=True, top_logprobs=5)
    assert choice.finish_reason == "tool_calls" and valid_calls(choice.message)
    tokens = choice.logprobs.content
    # The opening tag is the only token the grammar allows first.
    assert tokens[0].token == "<tool_call>" and len(tokens[0].top_logprobs) == 1
    assert max(len(t.top_logprobs) for t in tokens) == 5  # the path is the model's own
    assert all(math.isfinite(t.logprob) for t in tokens)


async def test_named_calls_always_call_that_tool(server):
    for name in SCHEMAS:
        named = {"type": "function", "function": {"name": name}}
        for choice in await ask_all(server, named, PROMPTS[:3]):  # named: one call
            assert choice.finish_reason == "tool_calls", choice.message
            calls = valid_calls(choice.message, names=(name,))
            assert len(calls) == 1


async def test_auto_with_strict_tools_or_a_json_format_gives_valid_calls(server):
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    for choice in await ask_all(server, "auto", PROMPTS[:3], tools=strict):
        assert choice.message.content or valid_calls(choice.message)
    answer = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 40}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    json_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}
    for choice in await ask_all(server, "auto", PROMPTS[:3], response_format=json_format):
        if not valid_calls(choice.message):
            jsonschema.validate(json.loads(choice.message.content), answer)


async def test_streamed_calls_reassemble_to_the_non_streamed_ones(server):
    whole = await ask_all(server, "required", PROMPTS[:3])
    client = server.async_client()
    for prompt, expected in zip(PROMPTS[:3], whole, strict=True):
        stream = await client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            max_tokens=80,
            stream=True,
        )
        calls: dict[int, dict] = {}
        finish, fragments = None, 0
        async for chunk in stream:
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for tc in c.delta.tool_calls or []:
                    if tc.index not in calls:
                        # The name comes first, with the call's id; then argument text.
                        assert tc.id and tc.function.name
                        calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
                    fragments += bool(tc.function.arguments)
        assert finish == "tool_calls"
        assert fragments > 1  # arguments streamed as generated, not in one piece
        got = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
        assert got == valid_calls(expected.message)
    await client.close()


def test_agent_loop_runs_turns_without_parse_failures(server, tmp_path):
    """A small coding agent: the model picks tools, we run them and feed results back."""
    (tmp_path / "util.py").write_text("def add(a, b):\n    return a - b\n")

    def run_tool(name: str, args: dict) -> str:
        path = tmp_path / str(args.get("path", "")).lstrip("/")
        if name == "read_file":
            return path.read_text() if path.is_file() else f"error: no such file {path.name}"
        if name == "write_file":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(args["content"])
            return f"wrote {len(args['content'])} characters to {path.name}"
        ok = "a + b" in (tmp_path / "util.py").read_text()
        return "1 passed" if ok else "FAILED test_add: add(2, 2) == 0, expected 4"

    client = server.client()
    messages = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "util.py has a bug in add(). Read it, fix it, run the tests."},
    ]
    turns = 0
    for choice_mode in ("required", "required", "required", "auto"):
        r = client.chat.completions.create(
            model=server.model,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice_mode,
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=120,
        )
        message = r.choices[0].message
        calls = valid_calls(message)  # any unparsable or invalid call fails here
        if choice_mode == "required":
            assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        if not calls:
            break
        turns += 1
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [tc.model_dump() for tc in message.tool_calls],
            }
        )
        for tc, (name, args) in zip(message.tool_calls, calls, strict=True):
            result = run_tool(name, args)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
    assert turns >= 3
