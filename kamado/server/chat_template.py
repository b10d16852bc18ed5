"""Chat messages -> prompt text, through the model's jinja template (or `--chat-template FILE`).

What peers got wrong and this does not (CLIENTS.md points 3-6): `content: null` beside
`tool_calls` renders as "", `role: "tool"` results reach the model, lists of text parts are
flattened, and nothing is HTML-escaped (transformers renders with autoescape off).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kamado.server.errors import APIError
from kamado.server.protocol import ChatMessage, Tool
from kamado.structured.tool_formats import detect_tool_format
from kamado.structured.tool_grammar import CLOSE, OPEN

# For templates that know nothing of tools: the Hermes/Qwen instructions, so the model still
# sees the tools (silently dropping them is CLIENTS.md point 1) and answers in tags we parse.
_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def flatten_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("text", "input_text") or part.text is None:
            raise APIError(
                f"{where}.content[{j}]: content parts of type {part.type!r} are not supported; "
                "this server takes text parts only ({'type': 'text', 'text': ...}).",
                param=f"{where}.content",
                code="unsupported_content",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(args: str | dict[str, Any]) -> Any:
    # Templates print arguments with `| tojson`; a JSON string would be printed double-encoded.
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


# Keywords apply_chat_template itself takes: a request may not set them through
# chat_template_kwargs.
_RESERVED_KWARGS = {"conversation", "messages", "tools", "chat_template", "tokenize",
                    "add_generation_prompt", "continue_final_message", "return_dict"}  # fmt: skip


def stable_history_options(source: str) -> dict[str, Any]:
    """Template options that keep an agent's earlier turns rendered the same on every turn,
    where the template has them: Qwen's `preserve_thinking` keeps past reasoning blocks in
    the history instead of dropping them once a new user message arrives, so the previous
    prompt stays a prefix of the next one and the prefix cache keeps hitting."""
    return {"preserve_thinking": True} if "preserve_thinking" in source else {}


class ChatTemplate:
    def __init__(
        self,
        tokenizer: Any,
        template_file: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.override = Path(template_file).read_text() if template_file else None
        source = self.override or getattr(tokenizer, "chat_template", None) or ""
        if isinstance(source, dict):  # several named templates: use the default one
            source = source.get("default") or next(iter(source.values()))
            self.override = source
        # Empty for a base model: /v1/completions still works, chat asks for a template.
        self.source: str = source
        # Variables the template renders with: history-stable ones, then the server's own.
        self.options = {**stable_history_options(source), **(options or {})}
        check_template_options(self.options, "--chat-template-kwargs")
        self.knows_tools = "tools" in source
        self.tool_format = detect_tool_format(source)
        # Whether the vocabulary has the tags as single tokens (Qwen does), not as plain text.
        self.tool_tags_are_tokens = tokenizer is not None and all(
            len(tokenizer.encode(tag, add_special_tokens=False)) == 1 for tag in (OPEN, CLOSE)
        )

    def messages_to_dicts(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(messages):
            role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
            d: dict[str, Any] = {
                "role": role,
                "content": flatten_content(m.content, f"messages[{i}]"),
            }
            if m.name is not None:
                d["name"] = m.name
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                calls = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments(c.function.arguments),
                        },
                    }
                    for c in m.tool_calls
                ]
                if self.knows_tools:
                    d["tool_calls"] = calls
                else:  # the template would drop them: show the model its own calls as text
                    shown = [
                        OPEN
                        + "\n"
                        + json.dumps(
                            {
                                "name": c["function"]["name"],
                                "arguments": c["function"]["arguments"],
                            },
                            ensure_ascii=False,
                        )
                        + "\n"
                        + CLOSE
                        for c in calls
                    ]
                    d["content"] = "\n".join(filter(None, [d["content"], *shown]))
            out.append(d)
        return out

    def render(
        self,
        messages: list[ChatMessage],
        tools: list[Tool] | None = None,
        options: dict[str, Any] | None = None,
    ) -> str:
        """Prompt text ending with the assistant generation prompt. `options` (a request's
        chat_template_kwargs) override the server's template variables."""
        if not messages:
            raise APIError("messages must contain at least one message.", param="messages")
        if not self.source:
            raise APIError(
                "This model has no chat template, so /v1/chat/completions cannot format "
                "messages; use /v1/completions, or restart the server with --chat-template FILE.",
                code="no_chat_template",
            )
        conversation = self.messages_to_dicts(messages)
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        if tool_dicts and not self.knows_tools:
            preamble = _TOOLS_PREAMBLE.format(
                tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tool_dicts)
            )
            if conversation[0]["role"] == "system":
                conversation[0]["content"] += "\n\n" + preamble
            else:
                conversation.insert(0, {"role": "system", "content": preamble})
            tool_dicts = None
        variables = {
            **self.options,
            **check_template_options(options or {}, "chat_template_kwargs"),
        }
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tools=tool_dicts,
                chat_template=self.override,
                tokenize=False,
                add_generation_prompt=True,
                **variables,
            )
        except Exception as e:  # jinja raise_exception(...) and template type errors alike
            raise APIError(
                f"The chat template could not render these messages: {e}",
                param="messages",
                code="chat_template_error",
            ) from None
        return text

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Rendered chat text carries its own special tokens; raw prompts get the model's BOS."""
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except UnicodeEncodeError:
            raise APIError(
                "The request contains text that is not valid Unicode (lone surrogates).",
                code="invalid_encoding",
            ) from None


def check_template_options(options: dict[str, Any], where: str) -> dict[str, Any]:
    if reserved := sorted(_RESERVED_KWARGS & options.keys()):
        raise APIError(
            f"{where} may not set {', '.join(reserved)}: the server sets these itself.",
            param=where,
        )
    return options
