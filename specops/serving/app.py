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
(`specops.serving.async_engine.chars_per_token_bound`), and one that cannot fit the
context is refused with the same 400 (``context_length_exceeded``) as the token count
check, without tokenizing it. Chat templating, tokenizing and decoding a prompt of
token ids run in a small thread pool, never on the event loop, so one large prompt
does not stall the streams of others.

When the engine thread fails, the requests in flight get a 500 in OpenAI's error
shape (``server_error``, code ``engine_error``), a stream an error event of that shape
and then its end (no ``[DONE]``), ``/readyz`` answers 503 with the reason, and
``on_engine_failure`` is called (``specops serve`` then exits; see
`specops.serving.async_engine`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specops.policies.turns import turn_from_messages
from specops.serving import protocol as p
from specops.serving.async_engine import (AsyncEngine, EngineFailedError, EngineUnavailableError, GenerationRequest,
                                          QueueFullError, RequestStream)
from specops.serving.chat_template import render_chat
from specops.webstack import metrics_response

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
LABEL_HEADER = "x-specops-label-"
ROUTING_HEADER = "x-specops-routing-key"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
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


class _ClosingStream(StreamingResponse):
    """An SSE response that ends its request however the response ends: finished, failed, or
    cancelled because the client left (also before the body iterator ever started, where the
    iterator's own ``finally`` would never run): the request is aborted unless it finished,
    and its slot is given back (`RequestStream.close`)."""

    def __init__(self, stream: RequestStream, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.stream = stream

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # its ``finally`` now, not when it is collected
            finally:
                self.stream.close()


class _Server:
    """What the routes need besides the engine client: fixed at build time."""

    def __init__(self, model_name: str, model_root: str, api_key: str | None) -> None:
        self.model_name = model_name
        self.model_root = model_root
        self.api_key = api_key


def build_app(load: Callable[[], AsyncEngine], *, model_name: str, model_root: str = "",
              api_key: str | None = None, on_load_error: Callable[[BaseException], None] | None = None,
              on_engine_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI app; ``load()`` runs in a thread at startup and returns the engine client.
    ``on_engine_failure(reason)`` runs on the event loop if the engine thread fails."""
    server = _Server(model_name, model_root or model_name, api_key)

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
                from specops.decoder.errors import DecoderError

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

    app = FastAPI(title="specops", version="1", lifespan=lifespan,
                  description="OpenAI-compatible serving with adaptive speculative decoding.")

    app.add_middleware(_Guard, limit=MAX_BODY_BYTES, api_key=api_key)

    # -- errors -----------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _param_from_loc(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON", param=None, code="invalid_json")
        msg = first.get("msg", "invalid request")
        return _error(400, f"{param}: {msg}" if param else msg, param=param)

    @app.exception_handler(p.ProtocolError)
    async def _protocol(request: Request, exc: p.ProtocolError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), type_, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return _error(500, "internal server error", "server_error")

    # -- plumbing routes -----------------------------------------------------------------
    def not_ready_reason(request: Request) -> str:
        client = request.app.state.client
        if client is None:
            return request.app.state.load_error or "models are loading"
        if client.engine_error is not None:
            return f"the engine failed: {client.engine_error}"
        return "the engine stopped"

    def client_or_503(request: Request) -> AsyncEngine:
        client = request.app.state.client
        if client is None or not client.running:
            raise p.ProtocolError(f"not ready: {not_ready_reason(request)}", status=503, type_="server_error",
                                  code="not_ready", headers={"Retry-After": "2"})
        return client

    @app.get("/health")
    @app.get("/healthz")
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok\n")

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        client = request.app.state.client
        if client is None:
            return JSONResponse({"ready": False, "reason": not_ready_reason(request)}, status_code=503)
        details = await asyncio.to_thread(client.status)
        ready = client.running
        body = {"ready": ready, "model": server.model_name, **details}
        if not ready:
            body["reason"] = not_ready_reason(request)
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        client = request.app.state.client
        if client is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return metrics_response(client.metrics.registry)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        client = client_or_503(request)
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": p.now_s(),
                                            "owned_by": "specops", "root": server.model_root, "parent": None,
                                            "max_model_len": client.max_model_len}]}

    # -- generation ------------------------------------------------------------------------
    def labels_and_key(request: Request, body: p._Common) -> tuple[dict[str, str], str | None]:
        labels = dict(body.metadata or {})
        for name, value in request.headers.items():
            if name.lower().startswith(LABEL_HEADER) and len(name) > len(LABEL_HEADER):
                labels[name.lower()[len(LABEL_HEADER):]] = value
        key = request.headers.get(ROUTING_HEADER) or body.user
        return labels, key

    def check_model(body: p._Common) -> None:
        if body.model is not None and body.model not in (server.model_name, server.model_root):
            raise p.ProtocolError(f"the model {body.model!r} does not exist; this server serves "
                                  f"{server.model_name!r}", "model", status=404, code="model_not_found")

    def too_long(client: AsyncEngine, prompt: str, param: str) -> p.ProtocolError:
        return p.ProtocolError(f"the prompt has {prompt}; this model's context is {client.max_model_len} tokens, "
                               "with at least one for the output", param, code="context_length_exceeded")

    def check_prompt_chars(client: AsyncEngine, chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context whatever it tokenizes to, without tokenizing it."""
        at_least = -(-chars // client.max_chars_per_token)
        if at_least >= client.max_model_len:
            raise too_long(client, f"{chars} characters, so at least {at_least} tokens", param)

    async def off_loop(request: Request, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the tokenizer threads (templating, tokenizing: not on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(request.app.state.tokenize_pool, fn, *args)

    def sampling(client: AsyncEngine, body: p._Common, prompt_len: int, limit: int | None, default: int | None,
                 limit_param: str):
        from specops.serving.sequence import SamplingParams

        room = client.max_model_len - prompt_len
        if room < 1:
            raise too_long(client, f"{prompt_len} tokens",
                           "messages" if isinstance(body, p.ChatCompletionRequest) else "prompt")
        max_tokens = limit if limit is not None else min(default or room, room)
        if max_tokens > room:
            raise p.ProtocolError(f"{limit_param}={max_tokens} plus the prompt's {prompt_len} tokens is over the "
                                  f"model's context of {client.max_model_len} tokens", limit_param,
                                  code="context_length_exceeded")
        params = SamplingParams(max_tokens=max_tokens, temperature=body.effective_temperature, top_p=body.top_p,
                                top_k=body.effective_top_k, seed=body.seed, ignore_eos=body.ignore_eos)
        try:
            params.config()
        except ValueError as exc:
            raise p.ProtocolError(str(exc), str(exc).split(" ", 1)[0]) from None
        return params

    async def submit(client: AsyncEngine, req: GenerationRequest):
        try:
            return await client.submit(req)
        except QueueFullError as exc:
            raise p.ProtocolError(str(exc), status=429, type_="rate_limit_error", code="queue_full",
                                  headers={"Retry-After": str(exc.retry_after_s)}) from None
        except EngineUnavailableError as exc:
            raise p.ProtocolError(str(exc), status=503, type_="server_error", code="not_ready",
                                  headers={"Retry-After": "2"}) from None
        except EngineFailedError as exc:
            raise engine_failed(exc) from None
        except ValueError as exc:  # PromptTooLongError and the engine's own parameter checks
            raise p.ProtocolError(str(exc), code="invalid_request") from None

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        client = client_or_503(request)
        body.check()
        check_model(body)
        prompt = body.prompt_value()
        tok = client.tokenizer
        if isinstance(prompt, str):
            if not prompt:
                raise p.ProtocolError("prompt is empty", "prompt")
            check_prompt_chars(client, len(prompt), "prompt")
            ids, text = await off_loop(request, tok.encode, prompt), prompt
        else:
            if len(prompt) >= client.max_model_len:
                raise too_long(client, f"{len(prompt)} tokens", "prompt")
            bad = [t for t in prompt if not 0 <= t < client.vocab_size]
            if bad:
                raise p.ProtocolError(f"prompt token id {bad[0]} is outside the vocabulary [0, {client.vocab_size})",
                                      "prompt")
            ids, text = prompt, await off_loop(request, tok.decode, prompt)
        if not ids:
            raise p.ProtocolError("prompt has no tokens", "prompt")
        params = sampling(client, body, len(ids), body.max_tokens, DEFAULT_COMPLETION_TOKENS, "max_tokens")
        labels, key = labels_and_key(request, body)
        req = GenerationRequest(ids, text, params, body.stop_list(), labels, key)
        return await respond(request, client, req, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        client = client_or_503(request)
        body.check()
        check_model(body)
        messages = [(m.role, m.text()) for m in body.messages]

        def prompt_ids() -> tuple[str, list[int]]:  # in the tokenizer threads
            rendered = render_chat(messages, client.tokenizer)
            check_prompt_chars(client, len(rendered), "messages")
            return rendered, client.tokenizer.encode(rendered)

        rendered, ids = await off_loop(request, prompt_ids)
        user_text = next((t for r, t in reversed(messages) if r == "user"), rendered)
        limit_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = sampling(client, body, len(ids), body.token_limit, None, limit_param)
        labels, key = labels_and_key(request, body)
        turn = turn_from_messages({"role": role} for role, _ in messages)
        req = GenerationRequest(ids, user_text, params, body.stop_list(), labels, key, turn=turn)
        return await respond(request, client, req, body, chat=True)

    def engine_failed(exc: EngineFailedError) -> p.ProtocolError:
        return p.ProtocolError(str(exc), status=500, type_="server_error", code="engine_error")

    async def respond(request: Request, client: AsyncEngine, req: GenerationRequest, body: p._Common, chat: bool):
        stream = await submit(client, req)
        rid = p.new_id("chatcmpl" if chat else "cmpl")
        created = p.now_s()
        model = server.model_name
        if body.stream:  # no await from here to the response: it closes the stream however it ends
            return _ClosingStream(stream, sse(stream, rid, created, model, chat, body.include_usage),
                                  media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def collect() -> tuple[str, str | None]:
            parts, reason = [], None
            it = stream.__aiter__()
            try:
                async for delta in it:
                    parts.append(delta.text)
                    reason = delta.finish_reason or reason
            finally:
                await it.aclose()
            return "".join(parts), reason

        try:
            result = await _unless_disconnected(request, collect())
        except EngineFailedError as exc:
            raise engine_failed(exc) from None
        finally:
            stream.close()
        if result is None:  # client gone; the stream aborted its request
            return Response(status_code=499)
        text, reason = result
        make = p.chat_body if chat else p.completion_body
        return make(rid, model, created, text, reason, stream.prompt_tokens, stream.completion_tokens,
                    stream.specops())

    async def sse(stream, rid: str, created: int, model: str, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
        def event(obj: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()

        it = stream.__aiter__()
        try:
            if chat:
                yield event(p.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None,
                                         with_usage=include_usage))
            async for delta in it:
                final = delta.finish_reason is not None
                if not delta.text and not final:
                    continue
                spec = stream.specops() if final else None
                if chat:
                    d = {"content": delta.text} if delta.text else {}
                    if final and delta.text:  # the text, then an empty delta carrying the finish reason
                        yield event(p.chat_chunk(rid, model, created, d, None, with_usage=include_usage))
                        d = {}
                    yield event(p.chat_chunk(rid, model, created, d, delta.finish_reason, spec, include_usage))
                else:
                    yield event(p.completion_chunk(rid, model, created, delta.text, delta.finish_reason, spec,
                                                   include_usage))
            if include_usage:
                yield event(p.usage_chunk(rid, model, created, "chat.completion.chunk" if chat else "text_completion",
                                          stream.prompt_tokens, stream.completion_tokens, stream.specops()))
            yield b"data: [DONE]\n\n"
        except EngineFailedError as exc:  # logged by the engine thread; the stream ends with the error
            yield event(p.error_body(str(exc), "server_error", code="engine_error"))
        except Exception:  # a bug here: the status line is sent, so the stream says so and ends
            log.exception("stream %s failed", rid)
            yield event(p.error_body("internal server error", "server_error", code="internal_error"))
        finally:
            await it.aclose()
            stream.close()

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


async def _unless_disconnected(request: Request, coro) -> Any:
    """Run ``coro``; None (and ``coro`` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return None
