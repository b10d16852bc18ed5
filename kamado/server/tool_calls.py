"""Tool calls out of model text, incrementally, so streams can carry them as deltas.

Two forms are recognised (the model's format, kamado/structured/tool_formats.py, decides
what a tagged call's body looks like):
- tags: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (hermes), or
  `<tool_call><function=NAME><parameter=P>...</function></tool_call>` (qwen3_coder), any
  number, anywhere in the reply; the name must be a declared tool.
- bare JSON (CLIENTS.md point 10): a reply that is *only* `{"name", "arguments"}`, bare or in
  a single ```json fence, naming a declared tool with arguments valid against its schema;
  or only several such objects (one after another, or as a JSON array), each valid.
  Small models write this instead of the tags; every peer server passed it on as text.
  It is also the llama3_json format's own form (`"parameters"` for `"arguments"`).
- Either form may wrap the call in OpenAI's tool shape, `{"type": "function", "function":
  {"name", "arguments"}}`: Qwen2.5's template lists the tools that way, and its small
  models write a call back in the same shape (seen under OpenCode).
- An argument given as null that its schema neither requires nor allows is left out, as
  the model meant (`_without_optional_nulls`).

Text that merely looks like a call is never lost: whatever does not parse is emitted as text.
Output that might still become a call is held back until it is decided. Only when the
grammar guarantees the calls (forced tool_choice, hermes format) does a call go out as it
is generated: its name first, then fragments of its arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kamado.server.json_schema import schema_errors
from kamado.structured.tool_formats import ToolFormat, parse_xml_call
from kamado.structured.tool_grammar import CLOSE, OPEN

FENCE = "```"


@dataclass
class TextEvent:
    text: str


@dataclass
class CallEvent:
    name: str
    arguments: str  # JSON text of an object
    bare: bool  # came from bare/fenced JSON rather than tags
    streamed: bool = False  # already sent as CallStartEvent + ArgumentsEvents


@dataclass
class CallStartEvent:
    name: str


@dataclass
class ArgumentsEvent:
    text: str  # the next piece of the current call's arguments JSON


Event = TextEvent | CallEvent | CallStartEvent | ArgumentsEvent

# How a constrained hermes call begins (the grammar writes JSON with ", " and ": ").
_CALL_HEAD = re.compile(r'\s*\{"name": "([^"\\]+)", "arguments": ')


def _brackets(s: str) -> tuple[list[tuple[int, str]], bool]:
    """The brackets of JSON text `s` that stand outside strings, with their indices, and
    whether `s` ends inside a string."""
    found: list[tuple[int, str]] = []
    in_str, esc = False, False
    for i, ch in enumerate(s):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[]}":
            found.append((i, ch))
    return found, in_str


def _json_object_end(s: str) -> int | None:
    """Index just past the JSON object starting at s[0] == "{", or None while it is open."""
    depth = 0
    for i, ch in _brackets(s)[0]:
        depth += 1 if ch in "{[" else -1
        if depth == 0:
            return i + 1
    return None


def _close_json(s: str) -> str | None:
    """`s` with the brackets it leaves open closed, if it ends between values; else None.

    Small models steered into a call often stop one `}` short: `{"name": "f", "arguments":
    {"x": 1}` then end of text. Closing what is open is unambiguous there.
    """
    brackets, in_str = _brackets(s)
    stack: list[str] = []
    for _, ch in brackets:
        if ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif not stack or stack.pop() != ch:
            return None
    if in_str or not stack:
        return None
    return s.rstrip() + "".join(reversed(stack))


def _objects_still_possible(s: str) -> bool:
    """Could `s` (stripped, partial) still be only JSON objects one after another, with
    whitespace or a comma between, or one array of them?"""
    if s.startswith("["):
        rest = s[1:].lstrip()
        if rest and rest[0] != "{":
            return False
        end = _json_object_end(s)  # counts [ and { alike
        return end is None or not s[end:].strip()
    while s:
        if not s.startswith("{"):
            return False
        rest = s[1:].lstrip()
        if rest and rest[0] != '"':
            return False  # "{ return x; }" and friends: code, not JSON
        end = _json_object_end(s)
        if end is None:
            return True
        s = s[end:].lstrip()
        s = s[1:].lstrip() if s.startswith(",") else s
    return True


def _bare_still_possible(buf: str) -> bool:
    """Could this (partial) reply still turn out to be only JSON tool calls?"""
    s = buf.lstrip()
    if s.startswith(FENCE):
        header, nl, body = s[3:].partition("\n")
        if not nl:
            return "json".startswith(header.strip().lower())
        if header.strip().lower() not in ("", "json"):
            return False
        closing = body.find(FENCE)
        inner = body.rstrip("`") if closing < 0 else body[:closing]  # the fence may be coming
        if not _objects_still_possible(inner.strip()):
            return False
        return closing < 0 or not body[closing + 3 :].strip()
    if s.startswith(("{", "[")):
        return _objects_still_possible(s)
    return bool(s) and FENCE.startswith(s)


def _json_values(body: str) -> list[Any] | None:
    """The values of `body` when it is JSON objects one after another (whitespace or a
    comma between) or one array of them; None when it is anything else."""
    decoder = json.JSONDecoder()
    body = body.strip()
    if body.startswith("["):
        try:
            values = json.loads(body)
        except json.JSONDecodeError:
            return None
        return values if isinstance(values, list) and values else None
    values, at = [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        values.append(value)
        at = len(body) - len(body[at:].lstrip())
        if body.startswith(",", at):
            at = len(body) - len(body[at + 1 :].lstrip())
    return values or None


def _unfence(s: str) -> str | None:
    s = s.strip()
    if not s.startswith(FENCE):
        return s
    _, nl, body = s[3:].partition("\n")
    if not nl:
        return None
    body = body.rstrip()
    if body.endswith(FENCE):
        body = body[:-3]
    return body if FENCE not in body else None


def _unwrapped(obj: Any) -> Any:
    """The call inside OpenAI's tool shape {"type": "function", "function": {...}}; else obj."""
    if (
        isinstance(obj, dict)
        and "name" not in obj
        and isinstance(obj.get("function"), dict)
        and obj.get("type", "function") == "function"
    ):
        return obj["function"]
    return obj


def _without_optional_nulls(args: dict[str, Any], schema: Any) -> dict[str, Any]:
    """args less the properties set to null that the schema neither requires nor allows
    to be null. Small models write `"path": null` for an optional argument they leave out
    (seen under OpenCode); a client that validates the call would refuse it, and a bare
    call would stay text."""
    if not isinstance(schema, dict) or None not in args.values():
        return args
    required = schema.get("required") or []
    properties = schema.get("properties") or {}
    return {
        key: value
        for key, value in args.items()
        if value is not None or key in required or not schema_errors(None, properties.get(key))
    }


class ToolCallParser:
    """Feed model text as it arrives; get text and whole tool calls back, in order."""

    def __init__(
        self,
        tools: dict[str, dict[str, Any] | None],
        bare_json: bool = True,
        fmt: ToolFormat = "hermes",
        stream_arguments: bool = False,
    ) -> None:
        self.tools = tools  # name -> parameters schema
        self.fmt = fmt
        # Calls are grammar-guaranteed: send each as it is generated, not once it is whole.
        self.stream_arguments = stream_arguments and fmt == "hermes"
        self._streaming: list[int] | None = None  # [arguments start, sent up to] in _buf
        # For llama3_json, a bare JSON call is the model's own format, not a fallback.
        self.bare_json = bare_json or fmt == "llama3_json"
        self.num_calls = 0
        self.num_bare_calls = 0
        self._mode = "start"  # start | text | tag | bare
        self._buf = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    # ---- internals ----------------------------------------------------------------------

    def _call(self, obj: Any, bare: bool, check_schema: bool | None = None) -> CallEvent | None:
        obj = _unwrapped(obj)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name = obj["name"]
        if name not in self.tools:
            return None
        key = "arguments" if "arguments" in obj else "parameters"
        if bare and key not in obj:
            return None
        args = obj.get(key, {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        schema = self.tools[name]
        args = _without_optional_nulls(args, schema)
        if (bare if check_schema is None else check_schema) and schema_errors(args, schema):
            return None
        return CallEvent(name, json.dumps(args, ensure_ascii=False), bare)

    def _parse_tagged(self, body: str, at_end: bool) -> CallEvent | None:
        if self.fmt == "qwen3_coder":
            parsed = parse_xml_call(body, self.tools)
            return (
                None
                if parsed is None
                else self._call({"name": parsed[0], "arguments": parsed[1]}, bare=False)
            )
        try:
            return self._call(json.loads(body), bare=False)
        except json.JSONDecodeError:
            pass
        closed = _close_json(body) if at_end else None
        if closed is None:
            return None
        try:
            # A repaired call must also fit its tool's schema.
            return self._call(json.loads(closed), bare=False, check_schema=True)
        except json.JSONDecodeError:
            return None

    def _parse_bare(self, text: str) -> list[CallEvent] | None:
        """The calls of a reply that is only JSON calls, every one valid; else None."""
        body = _unfence(text)
        values = None if body is None else _json_values(body)
        if values is None:
            return None
        calls = [call for value in values if (call := self._call(value, bare=True)) is not None]
        if len(calls) < len(values):
            return None  # all or nothing: a reply with one bad call stays text
        for call in calls:
            if self.fmt == "llama3_json":
                call.bare = False  # the model's own format: not counted as a fallback
        return calls

    def _stream_progress(self, events: list[Event]) -> None:
        """Send the name of the call being generated, then its arguments as they grow."""
        buf = self._buf
        if self._streaming is None:
            head = _CALL_HEAD.match(buf)
            if head is None or head.group(1) not in self.tools:
                return
            events.append(CallStartEvent(head.group(1)))
            self._streaming = [head.end(), head.end()]
        start, sent = self._streaming
        end = _json_object_end(buf[start:]) if buf[start:].startswith("{") else None
        upto = len(buf) if end is None else start + end
        if upto > sent:
            events.append(ArgumentsEvent(buf[sent:upto]))
            self._streaming[1] = upto

    def _emit(self, events: list[Event], ev: Event) -> None:
        if isinstance(ev, CallEvent):
            self.num_calls += 1
            self.num_bare_calls += ev.bare
        elif not ev.text:
            return
        events.append(ev)

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            buf = self._buf
            if self._mode == "start":
                s = buf.lstrip()
                if not s:
                    if final:
                        self._buf = ""
                        self._emit(events, TextEvent(buf))
                    return events
                if s.startswith(OPEN):
                    self._mode, self._buf = "tag", s[len(OPEN) :]
                elif OPEN.startswith(s) and not final:
                    return events  # maybe the start of a tag
                elif self.bare_json and s[0] in "{[`":
                    self._mode = "bare"
                else:
                    self._mode = "text"
            elif self._mode == "text":
                idx = buf.find(OPEN)
                if idx >= 0:
                    out, self._buf, self._mode = buf[:idx], buf[idx + len(OPEN) :], "tag"
                    if self.num_calls and not out.strip():
                        out = ""  # whitespace between calls
                    self._emit(events, TextEvent(out))
                    continue
                hold = 0
                if not final:
                    for k in range(min(len(OPEN) - 1, len(buf)), 0, -1):
                        if OPEN.startswith(buf[-k:]):
                            hold = k
                            break
                out = buf[: len(buf) - hold]
                if self.num_calls and not out.strip():
                    # Whitespace after a call: keep it until real text follows, drop at the end.
                    self._buf = "" if final else buf
                    return events
                self._buf = buf[len(out) :]
                self._emit(events, TextEvent(out))
                return events
            elif self._mode == "tag":
                idx = buf.find(CLOSE)
                if self.stream_arguments:
                    self._stream_progress(events)
                if idx < 0 and not final:
                    return events
                body = buf if idx < 0 else buf[:idx]
                raw = OPEN + body + ("" if idx < 0 else CLOSE)
                self._buf = "" if idx < 0 else buf[idx + len(CLOSE) :]
                self._mode = "text"
                call = self._parse_tagged(body, at_end=idx < 0)
                if self._streaming is not None:
                    # Already sent as it came; a call cut short by max_tokens stays as sent.
                    self._streaming = None
                    if call is not None:
                        call.streamed = True
                        self._emit(events, call)
                else:
                    self._emit(events, call or TextEvent(raw))
                if idx < 0:
                    return events
            else:  # bare
                if final:
                    self._buf = ""
                    for event in self._parse_bare(buf) or [TextEvent(buf)]:
                        self._emit(events, event)
                    return events
                if _bare_still_possible(buf):
                    return events
                self._mode = "text"


def declared_tools(tools: list[Any] | None, only: str | None = None) -> dict[str, Any]:
    """name -> parameters schema of the request's function tools (optionally just one)."""
    out: dict[str, Any] = {}
    for tool in tools or []:
        fn = tool.function
        if only is None or fn.name == only:
            out[fn.name] = fn.parameters
    return out
