"""How a model writes tool calls, named after the models that use each form:

- hermes (Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
- qwen3_coder: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n...
  </function>\\n</tool_call>`, values as raw text (strings) or JSON (other types)
- llama3_json (Llama 3.x): the call alone, as `{"name": ..., "parameters": {...}}`

The format is read from the chat template; `kamado serve --tool-call-format` overrides it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

ToolFormat = Literal["hermes", "qwen3_coder", "llama3_json"]
TOOL_FORMATS: tuple[ToolFormat, ...] = ("hermes", "qwen3_coder", "llama3_json")

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)


def detect_tool_format(template_source: str) -> ToolFormat:
    """The format the template writes calls in; hermes also for templates without tools
    (kamado's own tool preamble asks for <tool_call> tags)."""
    if "<function=" in template_source:
        return "qwen3_coder"
    if "tools" in template_source and "<tool_call>" not in template_source:
        return "llama3_json"
    return "hermes"


def is_string(schema: Any) -> bool:
    """Whether a parameter's value is written as raw text (not JSON) in qwen3_coder calls."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    return kinds == "string" or (isinstance(kinds, list) and "string" in kinds)


def _value(text: str, schema: Any) -> Any:
    if is_string(schema):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_xml_call(body: str, tools: dict[str, Any]) -> tuple[str, dict] | None:
    """(name, arguments) of a qwen3_coder call body, or None when it is not one."""
    match = _FUNCTION.fullmatch(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    props = (tools.get(name) or {}).get("properties") or {}
    args: dict[str, Any] = {}
    pos = 0
    for p in _PARAMETER.finditer(inner):
        if inner[pos : p.start()].strip():
            return None  # text between parameters: not a call
        key = p.group(1).strip()
        args[key] = _value(p.group(2), props.get(key))
        pos = p.end()
    if inner[pos:].strip():
        return None
    return name, args
