"""A small JSON-schema checker for tool arguments (the subset tool schemas use).

Used to decide whether bare JSON text is really a tool call, so it errs towards "does not
match" only on clear violations: unknown keywords are ignored, $ref is not followed.
"""

from __future__ import annotations

from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _is_type(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    kinds = _TYPES.get(name)
    return True if kinds is None else isinstance(value, kinds)


def schema_errors(value: Any, schema: Any, path: str = "$") -> list[str]:
    """Violations of `schema` by `value`, as human-readable strings (empty = valid)."""
    if not isinstance(schema, dict):
        return []
    errors: list[str] = []
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not any(_is_type(value, k) for k in kinds):
            return [f"{path}: expected {'/'.join(map(str, kinds))}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: must be {schema['const']!r}")
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if (
            isinstance(options, list)
            and options
            and all(schema_errors(value, option, path) for option in options)
        ):
            errors.append(f"{path}: matches none of {key}")
    for option in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        errors += schema_errors(value, option, path)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name in schema.get("required") or []:
            if name not in value:
                errors.append(f"{path}: missing required property {name!r}")
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in props:
                errors += schema_errors(item, props[name], f"{path}.{name}")
            elif extra is False:
                errors.append(f"{path}: unexpected property {name!r}")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, f"{path}.{name}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    return errors
