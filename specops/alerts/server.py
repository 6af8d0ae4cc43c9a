"""The controller's small HTTP server: ``/metrics``, ``/healthz`` and the alert webhooks.

A threaded stdlib server (no framework), started in a background thread and stopped
cleanly. Port 0 picks a free port; read it back from `.port`.

Routes
------
``GET /metrics``                  the injected prometheus_client registry, text format
``GET /healthz``                  200 ``ok`` (or 503 with the reason when ``health()`` says so)
``POST /webhook/alertmanager``    Alertmanager payload (version "4") → ``on_alert``
``POST /webhook/grafana``         Grafana webhook payload (version "1") → ``on_alert``
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from specops.alerts.webhook import MAX_BODY_BYTES, WebhookError, WebhookReceiver

log = logging.getLogger(__name__)

WEBHOOK_PREFIX = "/webhook/"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args) -> None:  # route access logs to logging, not stderr
        log.debug("%s %s", self.address_string(), fmt % args)

    def _send(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: dict) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

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
        else:
            self._send(404, b"not found\n")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if not path.startswith(WEBHOOK_PREFIX):
            self._send(404, b"not found\n")
            return
        source = path[len(WEBHOOK_PREFIX):]
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._json(400, {"error": "bad Content-Length"})
            return
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            self._json(413, {"error": f"payload must be 0..{MAX_BODY_BYTES} bytes"})
            return
        body = self.rfile.read(length)
        try:
            result = self.server.receiver.handle(source, self.headers.get("Authorization"), body)
        except WebhookError as exc:
            log.warning("webhook %s refused (%d): %s", source, exc.status, exc.message)
            self._json(exc.status, {"error": exc.message})
            return
        except Exception:
            log.exception("webhook %s: the alert callback failed", source)
            self._json(500, {"error": "alert callback failed; retry"})
            return
        self._json(200, {"actions": len(result.actions), "duplicates": result.duplicates, "ignored": result.ignored})


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
