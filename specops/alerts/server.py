"""The controller's HTTP server: ``/metrics``, ``/healthz`` and the alert webhooks.

A FastAPI app on uvicorn, the stack `specops serve` and `specops sidecar` run on
(`specops.webstack`), served from a background thread and stopped cleanly. Port 0 picks
a free port; read it back from `.port`.

Routes
------
``GET /metrics``                  the injected prometheus_client registry, text format
``GET /healthz``                  200 ``ok`` (or 503 with the reason when ``health()`` says so)
``GET /openapi.json``             this server's OpenAPI document (`specops.alerts.openapi`)
``POST /webhook/alertmanager``    Alertmanager payload (version "4") → ``on_alert``
``POST /webhook/grafana``         Grafana webhook payload (version "1") → ``on_alert``

Any other method on a route is 405 with ``Allow``; an unknown path is 404; both as
``{"error": ...}`` (the shape of every 4xx here).

The bearer token is checked before any of the body is read (a refusal answers at once and
closes the connection: the unread body is never parsed as a next request); a body is read
with each read under ``read_timeout_s`` (a silent client gets 408, never holds the request)
and at most ``MAX_BODY_BYTES`` (413), sent with ``Content-Length`` or ``Transfer-Encoding:
chunked``. A client's mistake is a 4xx, never a 5xx (Alertmanager retries 5xx); 503 with
``Retry-After`` means "not now" (not the leader, Redis down). The alert callback runs in a
worker thread (it writes to Redis), never on the event loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from specops.alerts.openapi import openapi_document
from specops.alerts.webhook import MAX_BODY_BYTES, WebhookError, WebhookReceiver
from specops.webstack import BackgroundServer, BodyError, metrics_response, read_body

log = logging.getLogger(__name__)

OPENAPI = json.dumps(openapi_document()).encode()
READ_TIMEOUT_S = 10.0  # each read of a webhook body


def build_app(receiver: WebhookReceiver, registry: CollectorRegistry, health: Callable[[], str | None], *,
              read_timeout_s: float = READ_TIMEOUT_S) -> FastAPI:
    """The controller's routes (see the module docstring)."""
    app = FastAPI(title="specops controller", version="1", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404 / 405 from the router
        message = "not found" if exc.status_code == 404 else "method not allowed" if exc.status_code == 405 \
            else str(exc.detail)
        return JSONResponse({"error": message}, status_code=exc.status_code, headers=exc.headers)

    @app.get("/metrics")
    def metrics() -> Response:
        return metrics_response(registry)

    @app.get("/healthz")
    def healthz() -> PlainTextResponse:
        problem = health()
        if problem:
            return PlainTextResponse(f"unhealthy: {problem}\n", status_code=503)
        return PlainTextResponse("ok\n")

    @app.get("/openapi.json")
    def openapi() -> Response:
        return Response(OPENAPI, media_type="application/json")

    @app.post("/webhook/{source}")
    async def webhook(source: str, request: Request) -> JSONResponse:
        auth = request.headers.get("authorization")
        try:
            receiver.authorize(auth)  # before reading a byte of the body
        except WebhookError as exc:
            log.warning("webhook %s refused (%d): %s", source, exc.status, exc.message)
            # the unread body must not be read as the next request: close, and say so (HTTP/1.1
            # clients otherwise reuse the connection and see it dropped instead of the 401)
            return JSONResponse({"error": exc.message}, status_code=exc.status,
                                headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
        try:
            body = await read_body(request, limit=MAX_BODY_BYTES, timeout_s=read_timeout_s)
        except BodyError as exc:
            return JSONResponse({"error": exc.message}, status_code=exc.status, headers={"Connection": "close"})
        try:
            result = await run_in_threadpool(receiver.handle, source, auth, body)
        except WebhookError as exc:
            log.warning("webhook %s refused (%d): %s", source, exc.status, exc.message)
            headers = {} if exc.retry_after_s is None else {"Retry-After": str(max(1, round(exc.retry_after_s)))}
            return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)
        except Exception:
            log.exception("webhook %s: the alert callback failed", source)
            return JSONResponse({"error": "alert callback failed; retry"}, status_code=500)
        answer: dict[str, Any] = {"actions": len(result.actions), "duplicates": result.duplicates,
                                  "ignored": result.ignored}
        if result.rejected:
            return JSONResponse({**answer, "error": "; ".join(result.rejected), "rejected": result.rejected},
                                status_code=422)
        return JSONResponse(answer)

    return app


class ControlServer:
    """``/metrics``, ``/healthz`` and the webhooks, served from a background thread.

    ``health()`` returns None when healthy, else a short reason (answered with 503).
    """

    def __init__(self, receiver: WebhookReceiver, registry: CollectorRegistry | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, health: Callable[[], str | None] = lambda: None,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.receiver = receiver
        self.registry = registry if registry is not None else CollectorRegistry()
        self.host = host
        self.app = build_app(receiver, self.registry, health, read_timeout_s=read_timeout_s)
        self._http = BackgroundServer(self.app, host=host, port=port, thread_name="specops-http")  # checks the port

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def url(self) -> str:
        return self._http.url

    def start(self) -> ControlServer:
        self._http.start()  # raises RuntimeError when already started
        log.info("serving /metrics, /healthz and webhooks on %s", self.url)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._http.stop(timeout_s)  # a no-op when not started

    def __enter__(self) -> ControlServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
