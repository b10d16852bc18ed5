"""Request body -> validated model; each way a body can be wrong is a 400 saying what to fix."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kamado.server.errors import APIError, from_validation_error

M = TypeVar("M", bound=BaseModel)

# ~16M tokens of text: far past any context, small enough that a runaway client cannot
# exhaust the server's memory.
MAX_BODY_BYTES = 64 << 20


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refusing (413) one larger than `limit` before reading it all."""
    declared = request.headers.get("content-length", "")
    too_big = APIError(
        f"The request body is larger than this server accepts ({limit >> 20} MiB).",
        status=413,
        code="body_too_large",
    )
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


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
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(
            f"The request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}.",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(obj, dict):
        raise APIError(
            f"The request body must be a JSON object, not {type(obj).__name__}.",
            code="invalid_json",
        )
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None
    except RecursionError:
        raise _too_deep() from None


def _too_deep() -> APIError:
    return APIError("The request body nests arrays or objects too deeply.", code="invalid_json")


def _reject_constant(name: str) -> None:
    # Python's json accepts NaN and Infinity, which are not JSON and no parameter can use.
    raise APIError(
        f"The request body is not valid JSON: {name} is not a JSON value.", code="invalid_json"
    )
