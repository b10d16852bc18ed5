"""Grammars that force a reply to be tool calls whose arguments fit the tools' schemas.

Calls are written the way the served model writes them: Hermes/Qwen tags
(`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`), or, for templates that
name tools without tags, the bare JSON object alone. The JSON of each call is embedded with
llguidance's %json{...}, so the arguments validate against the tool's parameters schema.
"""

from __future__ import annotations

import json
from typing import Any

from kamado.structured.constraint import Constraint, json_with_options

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON object of one call of `name`."""
    arguments = dict(parameters or ANY_ARGUMENTS)
    # Definitions move to the root, where the arguments' "#/$defs/..." references now point.
    defs = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **defs,
    }


def _term(text: str, is_token: bool) -> str:
    # A tag that is one token of the vocabulary is matched as that token, as the model emits it.
    return text if is_token else json.dumps(text)


def tool_call_constraint(
    tools: dict[str, dict[str, Any] | None],
    tags: bool,
    tags_are_tokens: bool,
    parallel: bool,
    or_json: dict[str, Any] | None = None,
) -> Constraint:
    """A Lark constraint: one call (or, with `parallel`, several) of the given tools.

    `or_json`, a JSON schema, allows a JSON reply of that schema instead of calls.
    """
    rules = []
    alternatives = []
    for i, (name, parameters) in enumerate(tools.items()):
        schema = json.dumps(json_with_options(call_schema(name, parameters)), ensure_ascii=False)
        rules.append(f"fn{i}: %json {schema}")
        alternatives.append(f"fn{i}")
    rules.append("fn: " + " | ".join(alternatives))
    if tags:
        open_, close = _term(OPEN, tags_are_tokens), _term(CLOSE, tags_are_tokens)
        rules.append(f'call: {open_} "\\n" fn "\\n" {close}')
        calls = 'call ("\\n" call)*' if parallel else "call"
    else:
        # Several bare objects would not parse as one reply: one call at most.
        rules.append("call: fn")
        calls = "call"
    start = f"start: {calls}"
    if or_json is not None:
        reply = json.dumps(json_with_options(or_json), ensure_ascii=False)
        rules.append(f"reply: %json {reply}")
        start += " | reply"
    return Constraint("lark", "\n".join([start, *rules]))
