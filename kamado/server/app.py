"""The FastAPI application: routes only; each endpoint's work lives in its own module."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kamado.server.chat import create_chat_completion
from kamado.server.completions import create_completion
from kamado.server.errors import install_error_handlers
from kamado.server.protocol import ModelCard, ModelList
from kamado.server.state import ServerState


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kamado", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kamado = state
    install_error_handlers(app)

    async def chat(request: Request) -> Any:
        return await create_chat_completion(state, request)

    async def completions(request: Request) -> Any:
        return await create_completion(state, request)

    async def models() -> Any:
        card = ModelCard(
            id=state.model_name, created=state.created, max_model_len=state.max_model_len
        )
        return ModelList(data=[card]).model_dump()

    # Clients differ on whether base_url ends in /v1; answer both.
    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/chat/completions", chat, methods=["POST"])
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/models", models, methods=["GET"])

    @app.get("/health")
    async def health() -> JSONResponse:
        h = state.health()
        return JSONResponse({"status": h.status, **h.detail}, status_code=200 if h.ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
