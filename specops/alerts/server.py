"""The controller's small HTTP server: ``/metrics``, ``/healthz`` and the alert webhooks.

A threaded stdlib server (no framework), started in a background thread and stopped
cleanly. Port 0 picks a free port; read it back from `.port`.

Routes
------
``GET /metrics``                  the injected prometheus_client registry, text format
``GET /healthz``                  200 ``ok`` (or 503 with the reason when ``health()`` says so)
``GET /openapi.json``             this server's OpenAPI document (`specops.alerts.openapi`)
``POST /webhook/alertmanager``    Alertmanager payload (version "4") → ``on_alert``
``POST /webhook/grafana``         Grafana webhook payload (version "1") → ``on_alert``

Any other method on a route is 405 with ``Allow``; an unknown path is 404.

The bearer token is checked before any of the body is read, every connection has a
socket timeout (a slow or silent client cannot hold a thread), and bodies may come
with ``Content-Length`` or ``Transfer-Encoding: chunked`` (at most
``MAX_BODY_BYTES`` either way). A client's mistake is a 4xx, never a 5xx (Alertmanager
retries 5xx); 503 with ``Retry-After`` means "not now" (not the leader, Redis down).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from specops.alerts.openapi import openapi_document
from specops.alerts.webhook import MAX_BODY_BYTES, WebhookError, WebhookReceiver

log = logging.getLogger(__name__)

WEBHOOK_PREFIX = "/webhook/"
GET_PATHS = ("/metrics", "/healthz", "/openapi.json")
OPENAPI = json.dumps(openapi_document()).encode()
SOCKET_TIMEOUT_S = 10.0
LINGER_S = 1.0  # at most this long discarding an unread body after a 401 / 413


class _BodyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S  # StreamRequestHandler sets it on the socket: reads and writes time out

    def log_message(self, fmt: str, *args) -> None:  # route access logs to logging, not stderr
        log.debug("%s %s", self.address_string(), fmt % args)

    def _send(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: dict, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _linger(self) -> None:
        """After an answer sent without reading the body: stop writing, then discard (never parse)
        what the client still sends, bounded in bytes and time. Closing with unread bytes would
        reset the connection, and a reset can drop the answer before the client reads it."""
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            left = MAX_BODY_BYTES
            while left > 0 and (chunk := self.connection.recv(min(65536, left))):
                left -= len(chunk)
        except OSError:  # the client went first, or the timeout: either way we are done
            pass

    def _read_body(self) -> bytes:
        """The request body (Content-Length or chunked), at most MAX_BODY_BYTES; raises _BodyError."""
        encoding = (self.headers.get("Transfer-Encoding") or "").strip().lower()
        if encoding:
            if encoding != "chunked":
                raise _BodyError(400, f"unsupported Transfer-Encoding {encoding!r}")
            return self._read_chunked()
        raw = self.headers.get("Content-Length")
        try:
            length = int(raw) if raw is not None else 0
        except ValueError:
            raise _BodyError(400, "bad Content-Length") from None
        if length < 0 or length > MAX_BODY_BYTES:
            raise _BodyError(413, f"payload must be 0..{MAX_BODY_BYTES} bytes")
        body = self.rfile.read(length)
        if len(body) != length:
            raise _BodyError(400, f"body ended after {len(body)} of {length} bytes")
        return body

    def _read_chunked(self) -> bytes:
        parts, total = [], 0
        while True:
            line = self.rfile.readline(1026)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BodyError(400, "malformed chunk size") from None
            if size < 0:
                raise _BodyError(400, "malformed chunk size")
            if size == 0:
                while self.rfile.readline(1026) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            total += size
            if total > MAX_BODY_BYTES:
                raise _BodyError(413, f"payload larger than {MAX_BODY_BYTES} bytes")
            chunk = self.rfile.read(size)
            if len(chunk) != size or self.rfile.read(2) not in (b"\r\n",):
                raise _BodyError(400, "truncated chunk")
            parts.append(chunk)

    def _wrong_method(self) -> None:
        """405 (or 404 for an unknown path); any body is left unread, so the connection closes."""
        path = self.path.split("?", 1)[0]
        allow = "GET" if path in GET_PATHS else "POST" if path.startswith(WEBHOOK_PREFIX) else None
        if allow is None:
            self._send(404, b"not found\n", headers={"Connection": "close"})
        else:
            self._send(405, b"method not allowed\n", headers={"Allow": allow, "Connection": "close"})
        self._linger()

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _wrong_method  # noqa: N815

    def do_HEAD(self) -> None:  # noqa: N802
        self._wrong_method()

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            problem = self.server.health()
            if problem:
                self._send(503, f"unhealthy: {problem}\n".encode())
            else:
                self._send(200, b"ok\n")
        elif path == "/openapi.json":
            self._send(200, OPENAPI, "application/json")
        elif path.startswith(WEBHOOK_PREFIX):
            self._wrong_method()
        else:
            self._send(404, b"not found\n")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path in GET_PATHS:
            self._wrong_method()
            return
        if not path.startswith(WEBHOOK_PREFIX):
            self._wrong_method()
            return
        source = path[len(WEBHOOK_PREFIX):]
        receiver = self.server.receiver
        try:
            receiver.authorize(self.headers.get("Authorization"))  # before reading a byte of the body
        except WebhookError as exc:
            log.warning("webhook %s refused (%d): %s", source, exc.status, exc.message)
            # the unread body must not be parsed as the next request: close, and say so (HTTP/1.1
            # clients otherwise reuse the connection and see it dropped instead of the 401)
            self._json(exc.status, {"error": exc.message}, {"WWW-Authenticate": "Bearer", "Connection": "close"})
            self._linger()
            return
        try:
            body = self._read_body()
        except _BodyError as exc:
            self._json(exc.status, {"error": str(exc)}, {"Connection": "close"})
            self._linger()
            return
        try:
            result = receiver.handle(source, self.headers.get("Authorization"), body)
        except WebhookError as exc:
            log.warning("webhook %s refused (%d): %s", source, exc.status, exc.message)
            headers = {} if exc.retry_after_s is None else {"Retry-After": str(max(1, round(exc.retry_after_s)))}
            self._json(exc.status, {"error": exc.message}, headers)
            return
        except Exception:
            log.exception("webhook %s: the alert callback failed", source)
            self._json(500, {"error": "alert callback failed; retry"})
            return
        answer = {"actions": len(result.actions), "duplicates": result.duplicates, "ignored": result.ignored}
        if result.rejected:
            self._json(422, {**answer, "error": "; ".join(result.rejected), "rejected": result.rejected})
            return
        self._json(200, answer)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, registry: CollectorRegistry, receiver: WebhookReceiver,
                 health: Callable[[], str | None]) -> None:
        self.registry = registry
        self.receiver = receiver
        self.health = health
        super().__init__(address, _Handler)


class ControlServer:
    """``/metrics``, ``/healthz`` and the webhooks, served from a background thread.

    ``health()`` returns None when healthy, else a short reason (answered with 503).
    """

    def __init__(self, receiver: WebhookReceiver, registry: CollectorRegistry | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, health: Callable[[], str | None] = lambda: None) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be within 0..65535, got {port}")
        self.receiver = receiver
        self.registry = registry if registry is not None else CollectorRegistry()
        self.host = host
        self._requested_port = port
        self._health = health
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ControlServer:
        if self._server is not None:
            raise RuntimeError("server already started")
        self._server = _Server((self.host, self._requested_port), self.registry, self.receiver, self._health)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="specops-http", daemon=True)
        self._thread.start()
        log.info("serving /metrics, /healthz and webhooks on %s", self.url)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._server = None
        self._thread = None

    def __enter__(self) -> ControlServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
