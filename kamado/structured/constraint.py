"""What a request constrains its output to, as plain picklable data, and its llguidance grammar.

A constraint travels inside SamplingParams from the server process to the engine process;
both sides turn it into the same llguidance grammar string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json_object", "json_schema", "regex", "lark"]

# JSON is written compactly with one space after ":" and ",": the form models learned from
# json.dumps. Free whitespace lets a small model wander into newlines until max_tokens.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class ConstraintError(ValueError):
    """The constraint cannot be compiled; the message says which part is wrong."""


@dataclass(frozen=True)
class Constraint:
    kind: Kind
    source: str = ""  # JSON schema text, regex, or Lark grammar; empty for json_object

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Constraint:
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    def grammar(self) -> str:
        """The llguidance grammar (JSON text) for this constraint."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                return LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)
            except ValueError as e:
                raise ConstraintError(str(e)) from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        raise ConstraintError(f"unknown constraint kind {self.kind!r}")


def json_with_options(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` carrying JSON_OPTIONS, for schemas embedded in a Lark grammar (%json{...})."""
    return {**schema, "x-guidance": JSON_OPTIONS}
