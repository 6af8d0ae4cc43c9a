"""The shared HTTP stack (`specops.webstack`): uvicorn in a thread, body limits, /metrics."""

from __future__ import annotations

import socket

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter

from specops.webstack import BackgroundServer, BodyError, metrics_response, read_body


def _app(limit: int = 64) -> FastAPI:
    app = FastAPI()
    registry = CollectorRegistry()
    Counter("specops_test_calls", "calls", registry=registry).inc(2)

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        try:
            body = await read_body(request, limit=limit, timeout_s=5)
        except BodyError as exc:
            return JSONResponse({"error": exc.message}, status_code=exc.status)
        return JSONResponse({"bytes": len(body)})

    @app.get("/metrics")
    def metrics():
        return metrics_response(registry)

    return app


def test_a_background_server_knows_its_port_at_once_and_frees_it():
    server = BackgroundServer(_app()).start()
    port = server.port
    assert port > 0 and httpx.post(f"{server.url}/echo", content=b"x" * 10).json() == {"bytes": 10}
    with pytest.raises(RuntimeError, match="already started"):
        server.start()
    server.stop()
    with pytest.raises(RuntimeError, match="not started"):
        _ = server.port
    with BackgroundServer(_app(), port=port) as again:  # the port is free again
        assert httpx.post(f"{again.url}/echo", content=b"").json() == {"bytes": 0}


def test_a_port_in_use_raises_in_the_callers_thread():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        with pytest.raises(OSError):
            BackgroundServer(_app(), port=taken.getsockname()[1]).start()
    finally:
        taken.close()
    with pytest.raises(ValueError, match="port"):
        BackgroundServer(_app(), port=70000)


def test_bodies_over_the_limit_are_413_declared_or_chunked():
    with BackgroundServer(_app(limit=64)) as server:
        assert httpx.post(f"{server.url}/echo", content=b"x" * 64).json() == {"bytes": 64}
        r = httpx.post(f"{server.url}/echo", content=b"x" * 65)  # Content-Length over the limit
        assert r.status_code == 413 and "0..64" in r.json()["error"]

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(5):
                yield b"x" * 20

        r = httpx.post(f"{server.url}/echo", content=chunks())
        assert r.status_code == 413 and "larger than 64" in r.json()["error"]


def test_metrics_response_is_prometheus_text():
    with BackgroundServer(_app()) as server:
        r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "specops_test_calls_total 2.0" in r.text
