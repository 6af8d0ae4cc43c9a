"""The OpenAI-compatible HTTP API (FastAPI): routes, SSE streaming, errors in OpenAI's shape.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE with
``stream: true``: ``data: {chunk}`` events, an optional usage chunk, ``data: [DONE]``),
``GET /v1/models``, ``GET /metrics``, ``GET /healthz`` (and ``GET /health``, the name
vLLM, SGLang and llama-server answer and load generators probe), ``GET /readyz``.

The app state holds the engine client (`AsyncEngine`), set once the ``load`` callable
has built it in a worker thread (until then ``/readyz`` and the generation routes
answer 503), and the thread pool that tokenizes. A client mistake is a 4xx naming the
parameter — never a 5xx or a traceback. A client that disconnects cancels its
request, wherever it is (see `RequestStream.close`).

Prompts are checked for size before they are tokenized: a text prompt of ``n``
characters has at least ``n / max_chars_per_token`` tokens
(`specops.engine.async_engine.chars_per_token_bound`), and one that cannot fit the
context is refused with the same 400 (``context_length_exceeded``) as the token count
check, without tokenizing it. Chat templating, tokenizing and decoding a prompt of
token ids run in a small thread pool, never on the event loop, so one large prompt
does not stall the streams of others.

When the engine thread fails, the requests in flight get a 500 in OpenAI's error
shape (``server_error``, code ``engine_error``), a stream an error event of that shape
and then its end (no ``[DONE]``), ``/readyz`` answers 503 with the reason, and
``on_engine_failure`` is called (``specops serve`` then exits; see
`specops.engine.async_engine`).

This module composes the app (`build_app`): its lifespan (loading the engine client), the
request guard (`_Guard`), the error handlers and the routes, which live in
`specops.server.routes_ops` (health, readiness, metrics, models) and
`specops.server.routes_generation` (completions, chat completions); the routes read the
engine client, the served model's names and the tokenizer threads from ``app.state``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specops.server import protocol as p
from specops.server import routes_generation, routes_ops
from specops.engine.async_engine import AsyncEngine
from specops.server.routes_ops import ServedModel

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
TOKENIZE_THREADS = min(4, os.cpu_count() or 1)  # threads that template, tokenize and decode prompts


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(p.error_body(message, type_, param, code), status_code=status, headers=headers)


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts = [str(x) for x in loc if x not in ("body",)]
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or None


class _Guard:
    """ASGI middleware (plain ASGI, not Starlette's ``BaseHTTPMiddleware``, which copies every
    streamed chunk through an extra task and memory stream): a bad or oversized Content-Length
    is refused before the body is read, the API key is checked on ``/v1/`` routes, and a body
    over ``limit`` bytes is refused with 413 while it is read, also when it comes chunked,
    without a Content-Length (memory stays bounded)."""

    def __init__(self, app: Any, limit: int, api_key: str | None) -> None:
        self.app = app
        self.limit = limit
        self.api_key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        total = 0

        async def limited() -> dict:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.limit:
                    raise StarletteHTTPException(413, f"request body over {self.limit} bytes")
            return message

        await self.app(scope, limited, send)

    def _refusal(self, scope: dict) -> JSONResponse | None:
        headers = {}
        for name, value in scope.get("headers", ()):
            if name in (b"content-length", b"authorization"):
                headers[name] = value.decode("latin-1")
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return _error(400, "bad Content-Length header")
            if int(length) > self.limit:
                return _error(413, f"request body over {self.limit} bytes")
        if self.api_key is not None and scope.get("path", "").startswith("/v1/"):
            scheme, _, token = headers.get(b"authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return _error(401, "missing or invalid API key (Authorization: Bearer <key>)",
                              code="invalid_api_key")
        return None


# -- errors -------------------------------------------------------------------------------------
async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _param_from_loc(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return _error(400, "request body is not valid JSON", param=None, code="invalid_json")
    msg = first.get("msg", "invalid request")
    return _error(400, f"{param}: {msg}" if param else msg, param=param)


async def _protocol(request: Request, exc: p.ProtocolError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error(exc.status_code, str(exc.detail), type_, headers=getattr(exc, "headers", None))


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error on %s", request.url.path)
    return _error(500, "internal server error", "server_error")


# -- the app ----------------------------------------------------------------------------------------
def _lifespan(load: Callable[[], AsyncEngine], model_name: str,
              on_load_error: Callable[[BaseException], None] | None,
              on_engine_failure: Callable[[str], None] | None):
    """The app's lifespan: the tokenizer threads, and ``load()`` run in a thread (the engine
    client in ``app.state.client`` once it has started, or ``app.state.load_error``); at the
    end the client stopped and the threads shut down."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.client = None
        app.state.load_error = None
        app.state.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="specops-tokenize")
        loop = asyncio.get_running_loop()

        async def load_in_thread() -> None:
            try:
                client = await asyncio.to_thread(load)
                client.start(loop, on_failure=on_engine_failure)
                app.state.client = client
                log.info("engine ready: %s", model_name)
            except BaseException as exc:  # report, and let the owner decide (the CLI exits)
                from specops.spec.errors import DecoderError

                if isinstance(exc, (OSError, ValueError, DecoderError)):  # a bad path / model: one line is enough
                    log.error("loading the engine failed: %s: %s", type(exc).__name__, exc)
                else:
                    log.exception("loading the engine failed")
                app.state.load_error = f"{type(exc).__name__}: {exc}"
                if on_load_error is not None:
                    on_load_error(exc)

        loader = asyncio.create_task(load_in_thread())
        try:
            yield
        finally:
            loader.cancel()
            client = app.state.client
            if client is not None:
                await asyncio.to_thread(client.stop)
            app.state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    return lifespan


def build_app(load: Callable[[], AsyncEngine], *, model_name: str, model_root: str = "",
              api_key: str | None = None, on_load_error: Callable[[BaseException], None] | None = None,
              on_engine_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI app; ``load()`` runs in a thread at startup and returns the engine client.
    ``on_engine_failure(reason)`` runs on the event loop if the engine thread fails."""
    app = FastAPI(title="specops", version="1",
                  lifespan=_lifespan(load, model_name, on_load_error, on_engine_failure),
                  description="OpenAI-compatible serving with adaptive speculative decoding.")
    app.state.served = ServedModel(model_name, model_root or model_name)
    app.add_middleware(_Guard, limit=MAX_BODY_BYTES, api_key=api_key)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(p.ProtocolError, _protocol)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _internal)
    routes_ops.add_routes(app)
    routes_generation.add_routes(app)
    if api_key is not None:
        app.openapi = lambda: _with_bearer(app)
    return app


def _with_bearer(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, saying that every ``/v1/`` route needs the bearer API key (the middleware checks it)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        doc.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in doc.get("paths", {}).items():
            if path.startswith("/v1/"):
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
                    operation.setdefault("responses", {})["401"] = {"description": "missing or invalid API key"}
        app.openapi_schema = doc
    return app.openapi_schema
