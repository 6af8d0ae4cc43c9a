"""The generation routes of the OpenAI-compatible API: ``POST /v1/completions`` and
``POST /v1/chat/completions``, answered as JSON or, with ``stream: true``, as SSE (``data:
{chunk}`` events, an optional usage chunk, ``data: [DONE]``).

A request's checks (model, prompt size, sampling parameters) raise `protocol.ProtocolError`,
which the app answers as a 4xx in OpenAI's shape; prompts are templated, tokenized and decoded
in the app's tokenizer threads (``app.state.tokenize_pool``), never on the event loop. A client
that disconnects cancels its request wherever it is (`_ClosingStream`, `_unless_disconnected`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from specops.policies.turns import turn_from_messages
from specops.server import protocol as p
from specops.engine.async_engine import (AsyncEngine, EngineFailedError, EngineUnavailableError, GenerationRequest,
                                          QueueFullError, RequestStream)
from specops.server.chat_template import render_chat
from specops.server.routes_ops import client_or_503, served

log = logging.getLogger(__name__)

LABEL_HEADER = "x-specops-label-"
ROUTING_HEADER = "x-specops-routing-key"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


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


# -- a request's checks ------------------------------------------------------------------------
def labels_and_key(request: Request, body: p._Common) -> tuple[dict[str, str], str | None]:
    labels = dict(body.metadata or {})
    for name, value in request.headers.items():
        if name.lower().startswith(LABEL_HEADER) and len(name) > len(LABEL_HEADER):
            labels[name.lower()[len(LABEL_HEADER):]] = value
    key = request.headers.get(ROUTING_HEADER) or body.user
    return labels, key


def check_model(request: Request, body: p._Common) -> None:
    model = served(request)
    if body.model is not None and body.model not in (model.model_name, model.model_root):
        raise p.ProtocolError(f"the model {body.model!r} does not exist; this server serves "
                              f"{model.model_name!r}", "model", status=404, code="model_not_found")


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
    from specops.engine.sequence import SamplingParams

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


def engine_failed(exc: EngineFailedError) -> p.ProtocolError:
    return p.ProtocolError(str(exc), status=500, type_="server_error", code="engine_error")


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


# -- the routes ----------------------------------------------------------------------------------
def add_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])


async def completions(body: p.CompletionRequest, request: Request):
    client = client_or_503(request)
    body.check()
    check_model(request, body)
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


async def chat_completions(body: p.ChatCompletionRequest, request: Request):
    client = client_or_503(request)
    body.check()
    check_model(request, body)
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


# -- the answer: JSON or SSE -----------------------------------------------------------------------
async def respond(request: Request, client: AsyncEngine, req: GenerationRequest, body: p._Common, chat: bool):
    stream = await submit(client, req)
    rid = p.new_id("chatcmpl" if chat else "cmpl")
    created = p.now_s()
    model = served(request).model_name
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
