"""The HTTP stack that `specops serve`, `specops sidecar` and `specops controller run` share: FastAPI
(Starlette) apps on uvicorn.

* `server_config` — the uvicorn options all three run with: no access log (the apps log what matters),
  no ``X-Forwarded-*`` rewriting (nothing reads the client address), a bounded graceful shutdown;
* `serve_until_signal` — uvicorn in the main thread until SIGINT / SIGTERM, returning so the caller's
  cleanup runs (the commands' embedded Redis must not outlive them);
* `BackgroundServer` — uvicorn in a daemon thread, on a socket the caller's thread binds (port 0 picks
  a free port that is known at once, and a port in use raises in the caller), stopped and joined;
* `metrics_response` — a prometheus_client registry in the text exposition format;
* `read_body` — a request body under a byte limit, each read under a time limit (uvicorn decodes
  ``Content-Length`` and ``Transfer-Encoding: chunked`` bodies alike).

Only light dependencies (no torch): the ops layer's servers import it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import Response

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def server_config(app: Any, *, host: str, port: int, log_level: str = "info", **options: Any) -> Any:
    """A ``uvicorn.Config`` with the options every specops server shares (``options`` override them)."""
    import uvicorn

    settings: dict[str, Any] = {"access_log": False, "proxy_headers": False,
                                "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S, **options}
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, **settings)


def serve_until_signal(server: Any) -> None:
    """Run a ``uvicorn.Server`` in this (main) thread until SIGINT / SIGTERM.

    uvicorn re-raises the signal that stopped it once it is done; with SIGTERM's default action that
    would kill the process before the caller's cleanup (``finally`` blocks) runs. A Python-level
    handler makes that re-raise harmless."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def metrics_response(registry: CollectorRegistry) -> Response:
    """``GET /metrics``: the registry in Prometheus' text format."""
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class BodyError(Exception):
    """A request body that cannot be read: ``status`` is the answer (400, 408 or 413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: Request, *, limit: int, timeout_s: float) -> bytes:
    """The whole body, at most ``limit`` bytes (413 beyond; a declared ``Content-Length`` over it is
    refused before a byte is read), each read within ``timeout_s`` (408: a silent client does not
    hold the request). Raises `BodyError`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise BodyError(400, "bad Content-Length") from None
        if not 0 <= length <= limit:
            raise BodyError(413, f"payload must be 0..{limit} bytes")
    parts, total = [], 0
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), timeout_s)
        except asyncio.TimeoutError:
            raise BodyError(408, f"no body bytes for {timeout_s:g} s") from None
        if message["type"] == "http.disconnect":
            raise BodyError(400, "the client closed the connection before the body ended")
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise BodyError(413, f"payload larger than {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


class BackgroundServer:
    """An ASGI app served by uvicorn from a daemon thread (``start`` / ``stop``, or a ``with`` block).

    ``options``: more `server_config` options (e.g. ``timeout_keep_alive``)."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 thread_name: str = "specops-http", **options: Any) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be within 0..65535, got {port}")
        self.app = app
        self.host = host
        self._requested_port = port
        self._log_level = log_level
        self._thread_name = thread_name
        self._options = options
        self._server: Any = None
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._failure: list[BaseException] = []

    @property
    def port(self) -> int:
        if self._socket is None:
            raise RuntimeError("server not started")
        return self._socket.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, ready_timeout_s: float = 10.0) -> BackgroundServer:
        """Bind (raises OSError here when the port is taken), then serve; returns once it accepts."""
        import uvicorn

        if self._socket is not None:
            raise RuntimeError("server already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._requested_port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self._socket = sock
        config = server_config(self.app, host=self.host, port=self.port, log_level=self._log_level,
                               **{"lifespan": "off", **self._options})
        self._server = uvicorn.Server(config)
        self._failure = []
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + ready_timeout_s
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self._server.started:
            self.stop()
            why = f": {self._failure[0]!r}" if self._failure else ""
            raise RuntimeError(f"the HTTP server did not start within {ready_timeout_s:g} s{why}")
        return self

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # reported by start(); the thread must not die silently
            self._failure.append(exc)
            log.exception("the HTTP server on %s:%s stopped", self.host, self._requested_port)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let running requests finish (bounded), close the socket, join the thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
