"""OpenAI-format errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kamado.server")


class APIError(Exception):
    """An error the client should see; raised anywhere before the response starts."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def model_not_found(requested: str, served: list[str]) -> APIError:
    return APIError(
        f"The model {requested!r} does not exist on this server; it serves: {', '.join(served)}.",
        status=404,
        param="model",
        code="model_not_found",
    )


def queue_full(retry_after_s: int) -> APIError:
    return APIError(
        "The server is at capacity (its request queue is full); retry shortly.",
        status=503,
        type="server_overloaded",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def engine_unavailable(detail: str) -> APIError:
    return APIError(
        f"The inference engine is not available: {detail}",
        status=503,
        type="server_error",
        code="engine_unavailable",
        headers={"Retry-After": "5"},
    )


def from_generation_failure(exc: Exception) -> APIError:
    """An exception out of the engine, as the error the client gets."""
    from kamado.engine.async_engine import EngineDeadError
    from kamado.engine.core import RequestError

    if isinstance(exc, RequestError):  # the engine's own validation: the request's fault
        return APIError(str(exc), code="invalid_request")
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    from kamado.server.generation import GenerationError

    if isinstance(exc, GenerationError):
        return APIError(
            f"Generation failed: {exc}",
            503,
            "server_error",
            code="generation_failed",
            headers={"Retry-After": "5"},
        )
    log.error("generation failed", exc_info=exc)
    return APIError(
        f"Internal error during generation: {type(exc).__name__}: {exc}",
        500,
        "server_error",
        code="internal_error",
    )


def _loc(loc: tuple[Any, ...]) -> str:
    """("messages", 0, "content") -> "messages[0].content"; drops pydantic's union-branch labels."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (
            part[:1].isupper() or "[" in part or part in ("str", "int", "float", "bool", "dict")
        ):
            continue  # e.g. "list[ContentPart]", "NamedToolChoice", "function-after[...]"
        else:
            out += f".{part}" if out else part
    return out


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first few field errors, each as `field: problem (got value)`, naming the field."""
    # The deepest location first: of a union's branches, the one that got furthest is the
    # one the client meant ("content[0].text must be a string", not "content must be a str").
    errors = sorted(exc.errors(), key=lambda e: -len(_loc(tuple(e.get("loc", ())))))
    seen: dict[str, str] = {}
    for err in errors:
        where = _loc(tuple(err.get("loc", ()))) or "body"
        if where in seen:  # a union reports once per branch; the first reason is enough
            continue
        got = err.get("input")
        shown = json.dumps(got, default=str)[:80] if err.get("type") != "missing" else None
        what = err.get("msg", "invalid value")
        seen[where] = f"{where}: {what}" + (f" (got {shown})" if shown is not None else "")
    parts = list(seen.values())
    message = "; ".join(parts[:5]) + (f"; and {len(parts) - 5} more" if len(parts) > 5 else "")
    first = next(iter(seen), None)
    return APIError(f"Invalid request: {message}", param=first, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(
            error_body(f"Internal server error: {type(exc).__name__}: {exc}", "server_error"),
            status_code=500,
        )
