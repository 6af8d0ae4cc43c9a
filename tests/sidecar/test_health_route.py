"""The sidecar answers ``GET /health`` (what vLLM, SGLang and llama-server answer, and load
generators such as GuideLLM probe) exactly like ``GET /healthz``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from specops.sidecar.proxy import build_app
from specops.sidecar.server import SidecarOptions, build_sidecar
from tests.services import free_port

DEFAULT = Path(__file__).resolve().parents[2] / "examples" / "policies" / "default.yaml"


def test_health_answers_like_healthz():
    closed = f"http://127.0.0.1:{free_port()}"  # no pool listening: health does not depend on them
    sidecar = build_sidecar(SidecarOptions(engine="vllm", upstreams={"spec": closed}, policy_file=str(DEFAULT)))
    app = build_app(sidecar)

    async def get(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sidecar") as http:
            return await http.get(path)

    health, healthz = asyncio.run(get("/health")), asyncio.run(get("/healthz"))
    assert health.status_code == healthz.status_code == 200
    assert health.json() == healthz.json() == {"ok": True}
    assert health.headers["content-type"] == healthz.headers["content-type"]
