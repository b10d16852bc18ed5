"""Grammars that force a reply to be tool calls whose arguments fit the tools' schemas, in
the served model's own call format (tool_formats.py).

JSON is embedded with llguidance's %json{...}, so arguments validate against the tool's
parameters schema. qwen3_coder writes string parameters as raw text; such a value runs
lazily up to the first "\\n</parameter>", the format's own end marker.
"""

from __future__ import annotations

import json
from typing import Any

from kamado.structured.constraint import Constraint, json_with_options
from kamado.structured.tool_formats import ToolFormat, is_string

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}
PARAM_END = "\n</parameter>\n"


def call_schema(name: str, parameters: dict[str, Any] | None, key: str = "arguments") -> dict:
    """The JSON object of one call of `name`."""
    arguments = dict(parameters or ANY_ARGUMENTS)
    # Definitions move to the root, where the arguments' "#/$defs/..." references now point.
    defs = {k: arguments.pop(k) for k in ("$defs", "definitions") if k in arguments}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: arguments},
        "required": ["name", key],
        "additionalProperties": False,
        **defs,
    }


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(json_with_options(schema), ensure_ascii=False)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _xml_call_rules(i: int, name: str, parameters: dict[str, Any] | None) -> list[str]:
    """qwen3_coder: declared parameters in schema order, the required ones mandatory."""
    params = parameters or ANY_ARGUMENTS
    required = set(params.get("required") or [])
    rules, parts = [], []
    for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
        rule = f"fn{i}_p{j}"
        opening = _lit(f"<parameter={key}>\n")
        if is_string(schema):
            # The lazy text ends with the format's own "\n</parameter>".
            rules.append(f'{rule}: {opening} {rule}_text "\\n"')
            rules.append(f"{rule}_text[lazy]: /(?s:.)*\\n<\\/parameter>/")
        else:
            rules.append(f"{rule}: {opening} {_json(schema)} {_lit(PARAM_END)}")
        parts.append(rule if key in required else f"{rule}?")
    opening = _lit(f"<function={name}>\n")
    rules.append(f"fn{i}: {opening} {' '.join(parts)} {_lit('</function>')}")
    return rules


def tool_call_constraint(
    tools: dict[str, dict[str, Any] | None],
    fmt: ToolFormat,
    tags_are_tokens: bool,
    parallel: bool,
    or_json: dict[str, Any] | None = None,
    or_text: bool = False,
) -> Constraint:
    """A Lark constraint: one call (or, with `parallel`, several) of the given tools.

    `or_json`, a JSON schema, allows a JSON reply of that schema instead of calls; `or_text`
    allows free text, before the calls or instead of them. Free text cannot contain a tag
    that is a single token, so any call in the reply is still a valid one.
    """
    rules = []
    for i, (name, parameters) in enumerate(tools.items()):
        if fmt == "qwen3_coder":
            rules += _xml_call_rules(i, name, parameters)
        else:
            key = "parameters" if fmt == "llama3_json" else "arguments"
            rules.append(f"fn{i}: {_json(call_schema(name, parameters, key))}")
    rules.append("fn: " + " | ".join(f"fn{i}" for i in range(len(tools))))
    if fmt == "llama3_json":
        # The bare object is the whole reply: one call at most.
        rules.append("call: fn")
        calls = "call"
    else:
        # A tag that is one token of the vocabulary is matched as that token, as models emit it.
        open_, close = (OPEN, CLOSE) if tags_are_tokens else (_lit(OPEN), _lit(CLOSE))
        rules.append(f'call: {open_} "\\n" fn "\\n" {close}')
        calls = 'call ("\\n" call)*' if parallel else "call"
        # Models end the last call's line before their end-of-turn token. Were that newline
        # allowed only between calls, it would commit the model to another call: Qwen2.5-Coder
        # 0.5B, made to call, repeated its call until max_tokens.
        calls += ' "\\n"?'
    start = f"start: {calls}"
    if or_json is not None:
        rules.append(f"reply: {_json(or_json)}")
        start += " | reply"
    elif or_text:
        start = f"start: TEXT? {calls} | TEXT"
        rules.append("TEXT: /(?s:.)+/")
    return Constraint("lark", "\n".join([start, *rules]))
