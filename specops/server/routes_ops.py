"""The plumbing routes of the OpenAI-compatible API: ``GET /healthz`` (and ``GET /health``),
``GET /readyz``, ``GET /metrics`` and ``GET /v1/models``; and how every route reads the app
state that `specops.server.app.build_app` sets: the served model's names (`ServedModel`,
fixed at build time) and the engine client (`client_or_503`, set once it has loaded).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from specops.server import protocol as p
from specops.engine.async_engine import AsyncEngine
from specops.webstack import metrics_response


@dataclass(frozen=True)
class ServedModel:
    """What the routes need besides the engine client: fixed at build time (``app.state.served``)."""

    model_name: str
    model_root: str


def served(request: Request) -> ServedModel:
    return request.app.state.served


def not_ready_reason(request: Request) -> str:
    client = request.app.state.client
    if client is None:
        return request.app.state.load_error or "models are loading"
    if client.engine_error is not None:
        return f"the engine failed: {client.engine_error}"
    return "the engine stopped"


def client_or_503(request: Request) -> AsyncEngine:
    """The running engine client, or a 503 ``not_ready`` (with ``Retry-After``) saying why not."""
    client = request.app.state.client
    if client is None or not client.running:
        raise p.ProtocolError(f"not ready: {not_ready_reason(request)}", status=503, type_="server_error",
                              code="not_ready", headers={"Retry-After": "2"})
    return client


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/health", healthz, methods=["GET"])  # the name vLLM, SGLang and llama-server answer
    app.add_api_route("/readyz", readyz, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])


async def healthz() -> PlainTextResponse:
    return PlainTextResponse("ok\n")


async def readyz(request: Request) -> JSONResponse:
    client = request.app.state.client
    if client is None:
        return JSONResponse({"ready": False, "reason": not_ready_reason(request)}, status_code=503)
    details = await asyncio.to_thread(client.status)
    ready = client.running
    body = {"ready": ready, "model": served(request).model_name, **details}
    if not ready:
        body["reason"] = not_ready_reason(request)
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    client = request.app.state.client
    if client is None:
        return Response(b"", media_type=CONTENT_TYPE_LATEST)
    return metrics_response(client.metrics.registry)


async def models(request: Request) -> dict[str, Any]:
    client = client_or_503(request)
    model = served(request)
    return {"object": "list", "data": [{"id": model.model_name, "object": "model", "created": p.now_s(),
                                        "owned_by": "specops", "root": model.model_root, "parent": None,
                                        "max_model_len": client.max_model_len}]}
