"""Request body -> validated model; each way a body can be wrong is a 400 saying what to fix."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from kamado.server.errors import APIError, from_validation_error

M = TypeVar("M", bound=BaseModel)


def decode_body(raw: bytes, model: type[M]) -> M:
    if not raw.strip():
        raise APIError("The request body is empty; send a JSON object.", code="empty_body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            f"The request body is not valid UTF-8 (bad byte at offset {e.start}); "
            "JSON must be UTF-8 encoded.",
            code="invalid_encoding",
        ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(
            f"The request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}.",
            code="invalid_json",
        ) from None
    if not isinstance(obj, dict):
        raise APIError(
            f"The request body must be a JSON object, not {type(obj).__name__}.",
            code="invalid_json",
        )
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None
