"""Request fields -> the grammar the reply must follow, checked before the request is admitted.

- response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"schema": {...}}} (enforced whether or not `strict` is set).
- extra body fields: `guided_regex` (a regular expression the whole reply matches) and
  `guided_grammar` (a Lark grammar, llguidance dialect).
- tools: with tool_choice "required" or a named function, the reply is the tool calls.
  Under "auto" with a JSON response_format, the reply is either calls or that JSON; under
  "auto" with a strict tool, text or valid calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kamado.server.errors import APIError
from kamado.server.protocol import _SamplingFields
from kamado.structured import Constraint, ConstraintError
from kamado.structured.tool_formats import ToolFormat
from kamado.structured.tool_grammar import tool_call_constraint
from kamado.structured.validation import check_constraint


@dataclass
class ToolConstraint:
    tools: dict[str, dict[str, Any] | None]  # name -> parameters schema, of callable tools
    declared: list[str]  # names of all tools in the request, in order (for error messages)
    fmt: ToolFormat
    tags_are_tokens: bool
    parallel: bool
    forced: bool  # required / named: the reply is calls and nothing else
    strict: bool  # a callable tool asks for strict arguments (function.strict)


async def _checked(constraint: Constraint, param: str) -> Constraint:
    try:
        # Off the event loop: a hard schema may take a while (bounded by check_constraint).
        await asyncio.to_thread(check_constraint, constraint)
    except ConstraintError as e:
        raise APIError(
            f"{param} cannot be used: {e}", param=param, code="invalid_constraint"
        ) from None
    return constraint


def _response_format(fmt: dict[str, Any] | None) -> tuple[dict[str, Any], str] | None:
    """The JSON schema the reply must follow, and the field it came from."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}, "response_format"
    if kind == "json_schema":
        spec = (fmt or {}).get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                "response_format.json_schema.schema must be a JSON schema object.",
                param="response_format.json_schema.schema",
            )
        return schema, "response_format.json_schema.schema"
    raise APIError(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema.",
        param="response_format.type",
    )


def _guided(req: _SamplingFields) -> tuple[Constraint, str] | None:
    regex, grammar = req.guided_regex, req.guided_grammar
    if regex is not None and grammar is not None:
        raise APIError("Send guided_regex or guided_grammar, not both.", param="guided_grammar")
    if regex is not None:
        return Constraint("regex", regex), "guided_regex"
    if grammar is not None:
        return Constraint("lark", grammar), "guided_grammar"
    return None


async def output_constraint(
    req: _SamplingFields,
    response_format: dict[str, Any] | None = None,
    tools: ToolConstraint | None = None,
) -> Constraint | None:
    """The request's constraint, compiled once here so a bad one is a 400 naming its field."""
    guided = _guided(req)
    json_reply = _response_format(response_format)
    if guided and json_reply:
        raise APIError(
            f"Send either {guided[1]} or a JSON response_format, not both.", param=guided[1]
        )
    if tools is None:
        if guided:
            return await _checked(*guided)
        if json_reply:
            return await _checked(Constraint.json_schema(json_reply[0]), json_reply[1])
        return None
    if guided:
        raise APIError(
            f"{guided[1]} cannot be combined with tools (unless tool_choice is none).",
            param=guided[1],
        )
    # Under auto, text may stand beside calls; a grammar can only keep it apart from calls
    # when the call tags are single tokens (text cannot spell them).
    text_beside_calls = tools.fmt != "llama3_json" and tools.tags_are_tokens
    if not tools.forced and not json_reply and not (tools.strict and text_beside_calls):
        return None  # auto: the model answers in text or calls, parsed as it comes
    # Each part on its own first, so that an error names the part.
    if json_reply:
        await _checked(Constraint.json_schema(json_reply[0]), json_reply[1])
    for name, parameters in tools.tools.items():
        if parameters is not None:
            param = f"tools[{tools.declared.index(name)}].function.parameters"
            await _checked(Constraint.json_schema(parameters), param)
    return await _checked(
        tool_call_constraint(
            tools.tools,
            tools.fmt,
            tools.tags_are_tokens,
            tools.parallel,
            or_json=None if tools.forced or not json_reply else json_reply[0],
            or_text=not tools.forced and not json_reply,
        ),
        "tools",
    )
