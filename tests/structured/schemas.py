"""JSON schemas for structured-output tests, each with a prompt a small model can answer.

Strings carry maxLength and arrays maxItems so every answer fits in a few dozen tokens.
"""

from __future__ import annotations

from typing import Any


def s(n: int = 24, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": n, **kw}


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **kw,
    }


def arr(items: dict[str, Any], lo: int = 0, hi: int = 3, **kw: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi, **kw}


INT = {"type": "integer"}
BOOL = {"type": "boolean"}

CASES: list[tuple[str, dict[str, Any]]] = [
    (
        "A person named Alice who is 31.",
        obj({"name": s(), "age": {**INT, "minimum": 0, "maximum": 150}}),
    ),
    ("A city and its country.", obj({"city": s(), "country": s()})),
    ("Is Python dynamically typed?", obj({"answer": BOOL})),
    ("Pick a colour.", obj({"colour": {"enum": ["red", "green", "blue"]}})),
    ("Rate this code from 1 to 5.", obj({"rating": {**INT, "minimum": 1, "maximum": 5}})),
    (
        "A temperature in Celsius between -50 and 60.",
        obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}}),
    ),
    ("Three fruits.", obj({"fruits": arr(s(12), 3, 3)})),
    ("Up to two programming languages.", obj({"languages": arr(s(12), 0, 2)})),
    ("A US zip code.", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    (
        "A semantic version number.",
        obj({"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}}),
    ),
    ("A hex colour code.", obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("A file path and whether it exists.", obj({"path": s(30), "exists": BOOL})),
    ("A user with an optional nickname.", obj({"user": s(), "nickname": s()}, required=["user"])),
    ("A point in 2D.", obj({"x": INT, "y": INT})),
    (
        "A rectangle with two corners.",
        obj({"top_left": obj({"x": INT, "y": INT}), "bottom_right": obj({"x": INT, "y": INT})}),
    ),
    ("A book with title and author.", obj({"book": obj({"title": s(), "author": s()})})),
    ("An HTTP status code.", obj({"status": {**INT, "minimum": 100, "maximum": 599}})),
    ("A log level.", obj({"level": {"enum": ["debug", "info", "warning", "error"]}})),
    ("A percentage.", obj({"percent": {"type": "number", "minimum": 0, "maximum": 100}})),
    (
        "A list of up to three small integers.",
        obj({"numbers": arr({**INT, "minimum": 0, "maximum": 9}, 1, 3)}),
    ),
    (
        "A task with a priority.",
        obj({"task": s(), "priority": {"enum": ["low", "medium", "high"]}}),
    ),
    (
        "A git commit: hash prefix and message.",
        obj({"sha": {"type": "string", "pattern": "^[0-9a-f]{7}$"}, "message": s(30)}),
    ),
    (
        "A function name and its arity.",
        obj({"function": s(), "arity": {**INT, "minimum": 0, "maximum": 5}}),
    ),
    (
        "A yes or no answer with a reason.",
        obj({"answer": {"enum": ["yes", "no"]}, "reason": s(30)}),
    ),
    ("A date.", obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    (
        "A time of day.",
        obj(
            {
                "hour": {**INT, "minimum": 0, "maximum": 23},
                "minute": {**INT, "minimum": 0, "maximum": 59},
            }
        ),
    ),
    ("A team with members.", obj({"team": s(), "members": arr(obj({"name": s(12)}), 1, 2)})),
    (
        "A key-value setting.",
        obj({"key": s(), "value": {"type": ["string", "integer", "boolean"]}}),
    ),
    (
        "A nullable middle name.",
        obj({"first": s(), "middle": {"type": ["string", "null"], "maxLength": 12}}),
    ),
    (
        "An animal that is either a cat or a dog.",
        obj({"animal": {"anyOf": [{"const": "cat"}, {"const": "dog"}]}}),
    ),
    (
        "A shape: circle with radius.",
        obj(
            {
                "shape": {"const": "circle"},
                "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
            }
        ),
    ),
    ("A weekday.", obj({"day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}})),
    ("An empty list of errors.", obj({"errors": arr(s(), 0, 0)})),
    (
        "Coordinates as a pair.",
        obj(
            {
                "coords": {
                    "type": "array",
                    "prefixItems": [{"type": "number"}, {"type": "number"}],
                    "items": False,
                    "minItems": 2,
                }
            }
        ),
    ),
    ("A boolean flag set.", obj({"verbose": BOOL, "dry_run": BOOL, "force": BOOL})),
    (
        "A Python package and version.",
        obj(
            {"package": {"type": "string", "pattern": "^[a-z][a-z0-9_-]{0,20}$"}, "version": s(10)}
        ),
    ),
    (
        "A test result summary.",
        obj({"passed": {**INT, "minimum": 0}, "failed": {**INT, "minimum": 0, "maximum": 1000}}),
    ),
    (
        "A nested config.",
        obj({"server": obj({"host": s(), "port": {**INT, "minimum": 1, "maximum": 65535}})}),
    ),
    ("A deeply nested value.", obj({"a": obj({"b": obj({"c": INT})})})),
    (
        "A list of files changed.",
        obj(
            {
                "files": arr(
                    obj({"path": s(20), "lines": {**INT, "minimum": 0, "maximum": 999}}), 1, 2
                )
            }
        ),
    ),
    (
        "A word and its length.",
        obj({"word": s(12), "length": {**INT, "minimum": 1, "maximum": 12}}),
    ),
    (
        "An email address.",
        obj({"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"}}),
    ),
    ("A score between 0 and 1.", obj({"score": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("A short tag list.", obj({"tags": arr(s(10), 1, 3)})),
    ("A greeting message.", obj({"greeting": s(30, minLength=2)})),
    (
        "A variable name in snake_case.",
        obj({"name": {"type": "string", "pattern": "^[a-z]+(_[a-z]+){0,2}$"}}),
    ),
    (
        "An optional comment and a required id.",
        obj({"id": {**INT, "minimum": 1, "maximum": 99}, "comment": s()}, required=["id"]),
    ),
    (
        "A matrix of two rows of two integers.",
        obj({"matrix": arr(arr({**INT, "minimum": -9, "maximum": 9}, 2, 2), 2, 2)}),
    ),
    (
        "A result that is ok or error.",
        obj({"result": {"oneOf": [obj({"ok": BOOL}), obj({"error": s()})]}}),
    ),
    (
        "A product with a price.",
        obj({"product": s(), "price": {"type": "number", "minimum": 0, "maximum": 1000}}),
    ),
    ("Any JSON object describing a dog.", {"type": "object"}),
    ("An array of two words.", arr(s(10), 2, 2)),
    ("A single integer from 1 to 10.", {"type": "integer", "minimum": 1, "maximum": 10}),
    (
        "A schema with a definition reused twice.",
        {
            "$defs": {"pt": obj({"x": INT, "y": INT})},
            **obj({"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}}),
        },
    ),
]
