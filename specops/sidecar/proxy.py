"""The sidecar's HTTP side: an OpenAI-compatible reverse proxy that routes by request class.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE passed
through byte for byte as the engine sends it), ``GET /v1/models`` (from the first
pool that answers), ``GET /metrics``, ``GET /healthz``, ``GET /readyz``.

Per request: classify and pick a pool (`Router`), forward the body unchanged,
time the stream (TTFT, chunk gaps) while passing its bytes on, read the engine's
speculation fields (`fields.extract`) and account a `DecodeRecord` (`telemetry`).
Responses carry ``x-specops-class`` and ``x-specops-pool`` headers.

Failure handling (nothing hangs: every upstream call has a connect and a per-read
timeout, and a stream a total deadline):
- a client mistake (bad JSON, body not an object, over 4 MiB) → 4xx in OpenAI's shape;
- the pool cannot be reached or answers 502-504 → the other pool when the policy's
  ``upstreams.failover`` allows, else 502 in OpenAI's shape; no answer within the
  read timeout → 504 at once (the engine may still be running it: no second copy);
- a non-JSON 200 body → 502 ``upstream_malformed``;
- a stream that breaks, stalls past the read timeout or passes the deadline → an
  SSE ``data: {"error": ...}`` event, then the stream ends (the status line is gone).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from specops.sidecar import fields
from specops.sidecar.routing import Route, Router
from specops.sidecar.scrape import EngineScraper
from specops.sidecar.telemetry import Observation, PoolSpeed, to_record

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
LABEL_HEADER = "x-specops-label-"
ROUTING_HEADER = "x-specops-routing-key"
FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id", "openai-organization")
RETRY_STATUS = (502, 503, 504)
MAX_EVENT_BYTES = 1024 * 1024  # the watcher's parse buffer; the relayed bytes are never held


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code), status_code=status, headers=headers)


@dataclass
class SidecarConfig:
    engine: str
    upstreams: dict[str, str]        # pool name -> base URL (no trailing /v1)
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 60.0     # longest silence between two chunks
    request_timeout_s: float = 600.0  # a whole request, streams included
    poll_s: float = 0.2
    scrape_s: float = 5.0


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("specops_sidecar_requests", "Proxied requests by pool, class and outcome",
                                ["pool", "class", "outcome"], registry=registry)
        self.upstream_errors = Counter("specops_sidecar_upstream_errors", "Upstream failures by pool and kind",
                                       ["pool", "kind"], registry=registry)
        self.failovers = Counter("specops_sidecar_failovers", "Requests sent to the other pool", ["from_pool"],
                                 registry=registry)
        self.inconclusive = Counter("specops_sidecar_inconclusive", "Requests without usable engine spec fields",
                                    ["pool", "class"], registry=registry)
        self.policy_stale = Gauge("specops_sidecar_policy_stale", "1 while routing on last known settings",
                                  registry=registry)
        self.unenforceable = Gauge("specops_sidecar_fallback_unenforceable",
                                   "1 when only one pool exists, so fallbacks are reported but not enforced",
                                   registry=registry)


class Sidecar:
    """Everything the routes need: router, HTTP client, telemetry sinks."""

    def __init__(self, cfg: SidecarConfig, router: Router, *, registry: CollectorRegistry, exporter: Any = None,
                 records: Any = None, speed: PoolSpeed | None = None) -> None:
        if cfg.engine not in fields.ENGINES:
            raise ValueError(f"engine must be one of {', '.join(fields.ENGINES)}, got {cfg.engine!r}")
        self.cfg = cfg
        self.router = router
        self.registry = registry
        self.exporter = exporter
        self.records = records
        self.speed = speed or PoolSpeed()
        self.metrics = SidecarMetrics(registry)
        self.metrics.unenforceable.set(1 if router.single else 0)
        self.scraper = EngineScraper(cfg.engine, cfg.upstreams, registry=registry)
        self.client: httpx.AsyncClient | None = None

    def timeout(self) -> httpx.Timeout:
        c = self.cfg
        return httpx.Timeout(connect=c.connect_timeout_s, read=c.read_timeout_s, write=c.read_timeout_s,
                             pool=c.connect_timeout_s)

    # -- telemetry ---------------------------------------------------------------------
    def account(self, route: Route, obs: Observation) -> None:
        u = self.router.upstreams
        plain_pool = self.router.pool_name(u.plain)
        if not obs.spec_pool:
            self.speed.observe(obs.pool, obs)
        plain_tps = None if self.router.single else self.speed.tps(plain_pool)
        if obs.counts is None and obs.spec_pool:
            self.metrics.inconclusive.labels(obs.pool, route.request_class).inc()
        try:
            record = to_record(route, obs, plain_tps)
        except ValueError as exc:  # inconsistent engine numbers: count the request, not the data
            log.warning("dropped a record for class %s: %s", route.request_class, exc)
            return
        if self.exporter is not None:
            self.exporter.observe(record)
        if self.records is not None:
            self.records.add(record, canary=route.canary)

    async def background(self) -> None:
        """Policy refresh + record flush every ``poll_s``; engine scrape every ``scrape_s``."""
        next_scrape = 0.0
        live = self.router.live
        while True:
            try:
                if live is not None:
                    await asyncio.to_thread(live.poll)
                    self.metrics.policy_stale.set(1 if live.stale else 0)
                if self.records is not None:
                    await asyncio.to_thread(self.records.flush)
                if next_scrape == 0.0:
                    next_scrape = time.monotonic() + self.cfg.scrape_s
                elif time.monotonic() >= next_scrape and self.client is not None:
                    next_scrape = time.monotonic() + self.cfg.scrape_s
                    await self.scraper.scrape(self.client)
            except asyncio.CancelledError:
                raise
            except Exception:  # keep the loop alive whatever one round did
                log.exception("sidecar background round failed")
            await asyncio.sleep(self.cfg.poll_s)


def _prompt_text(path: str, body: dict[str, Any]) -> str:
    if path.endswith("chat/completions"):
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str))
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        return prompt[0]
    return ""


def _labels_and_key(request: Request, body: dict[str, Any]) -> tuple[dict[str, str], str | None]:
    meta = body.get("metadata")
    labels = {str(k): v for k, v in meta.items() if isinstance(v, str)} if isinstance(meta, dict) else {}
    for name, value in request.headers.items():
        if name.lower().startswith(LABEL_HEADER):
            labels[name.lower()[len(LABEL_HEADER):]] = value
    key = request.headers.get(ROUTING_HEADER)
    if key is None and isinstance(body.get("user"), str):
        key = body["user"]
    return labels, key


def _has_content(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    if not isinstance(choices, list):
        return False
    for c in choices:
        if not isinstance(c, dict):
            continue
        if isinstance(c.get("text"), str) and c["text"]:
            return True
        delta = c.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("content"), str) and delta["content"]:
            return True
    return False


class _StreamWatcher:
    """Splits the passed-through bytes into SSE events and times the content ones."""

    def __init__(self, engine: str, started: float) -> None:
        self.engine = engine
        self.started = started
        self.buffer = b""
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.chunks = 0
        self.usage: int | None = None
        self.counts: fields.SpecCounts | None = None
        self.done = False
        self.malformed = 0

    def feed(self, data: bytes, now: float) -> None:
        self.buffer += data.replace(b"\r\n", b"\n")
        if len(self.buffer) > MAX_EVENT_BYTES and b"\n\n" not in self.buffer:
            self.malformed += 1  # not SSE (or one giant event): stop parsing it, keep relaying it
            self.buffer = b""
            return
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            payload = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
            if payload:
                self._event(payload, now)

    def _event(self, payload: bytes, now: float) -> None:
        if payload.strip() == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(payload)
        except ValueError:
            self.malformed += 1
            return
        if not isinstance(event, dict):
            self.malformed += 1
            return
        counts = fields.extract(self.engine, event)
        if counts is not None:
            self.counts = counts
        tokens = fields.completion_tokens(event)
        if tokens is not None:
            self.usage = tokens
        if _has_content(event):
            self.chunks += 1
            if self.first is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.last = now


def build_app(sidecar: Sidecar) -> FastAPI:
    """The FastAPI app around one `Sidecar`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sidecar.client = httpx.AsyncClient(timeout=sidecar.timeout(),
                                           limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
        await sidecar.scraper.scrape(sidecar.client)  # /readyz knows the pools from the start
        task = asyncio.create_task(sidecar.background())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await sidecar.client.aclose()

    app = FastAPI(title="specops sidecar", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    async def read_body(request: Request) -> bytes | JSONResponse:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
        return raw

    def forward_headers(request: Request) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items()
               if k.lower() in FORWARD_HEADERS or k.lower().startswith("x-specops-")}
        out.setdefault("content-type", "application/json")
        return out

    async def proxy(request: Request, path: str) -> Response:
        raw = await read_body(request)
        if isinstance(raw, JSONResponse):
            return raw
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        labels, key = _labels_and_key(request, body)
        temperature = body.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
            temperature = 1.0  # the engine answers the client's mistake itself
        route = sidecar.router.route(_prompt_text(path, body), labels=labels, routing_key=key,
                                     temperature=float(temperature))
        stream = body.get("stream") is True
        headers = forward_headers(request)
        started = time.monotonic()
        pool = route.pool
        tried: list[str] = []
        while True:
            tried.append(pool)
            url = sidecar.cfg.upstreams[pool].rstrip("/") + path
            kind, detail, resp = await _send(sidecar.client, url, raw, headers, stream)
            last_bad = None
            if kind is None and resp.status_code in RETRY_STATUS:
                kind, detail = f"http_{resp.status_code}", f"answered {resp.status_code}"
                last_bad = (resp.status_code, await resp.aread(), resp.headers.get("content-type", ""))
                await resp.aclose()
            if kind is None:
                break
            sidecar.metrics.upstream_errors.labels(pool, kind).inc()
            # a timed-out request may still be running there: sending it again would double the load
            other = sidecar.router.failover_pool(pool) if kind != "timeout" else None
            if other is not None and other not in tried:
                log.warning("pool %s %s; failing over to %s", pool, detail, other)
                sidecar.metrics.failovers.labels(pool).inc()
                pool = other
                continue
            sidecar.metrics.requests.labels(pool, route.request_class, "upstream_error").inc()
            if last_bad is not None and kind.startswith("http_"):
                status, content, ctype = last_bad
                return Response(content, status_code=status, media_type=ctype or None)
            status = 504 if kind == "timeout" else 502
            return _error(status, f"upstream pool {pool!r} {detail}", "upstream_error", f"upstream_{kind}")
        u = sidecar.router.upstreams
        spec_pool = route.method != "ar" and (pool == sidecar.router.pool_name(u.spec) or sidecar.router.single)
        out_headers = {"x-specops-class": route.request_class, "x-specops-pool": pool}
        if route.probe:
            out_headers["x-specops-probe"] = "1"
        if resp.status_code != 200:  # the engine's own answer (4xx: the client's mistake) goes back as is
            content = await resp.aread()
            await resp.aclose()
            sidecar.metrics.requests.labels(pool, route.request_class, f"http_{resp.status_code}").inc()
            return Response(content, status_code=resp.status_code, headers=out_headers,
                            media_type=resp.headers.get("content-type"))
        if not stream:
            try:
                data = resp.json()
            except ValueError:
                sidecar.metrics.upstream_errors.labels(pool, "malformed").inc()
                sidecar.metrics.requests.labels(pool, route.request_class, "upstream_error").inc()
                return _error(502, f"upstream pool {pool!r} returned a body that is not JSON", "upstream_error",
                              "upstream_malformed", headers=out_headers)
            wall = time.monotonic() - started
            obs = Observation(pool, spec_pool, wall, usage_tokens=fields.completion_tokens(data),
                              counts=fields.extract(sidecar.cfg.engine, data))
            if obs.usage_tokens is None and isinstance(data, dict):
                obs.chunks = 1 if _has_content(data) else 0
            sidecar.account(route, obs)
            sidecar.metrics.requests.labels(pool, route.request_class, "ok").inc()
            return Response(resp.content, status_code=200, headers=out_headers,
                            media_type=resp.headers.get("content-type", "application/json"))
        return StreamingResponse(_relay(sidecar, resp, route, pool, spec_pool, started), headers=out_headers,
                                 media_type=resp.headers.get("content-type", "text/event-stream"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = forward_headers(request)
        for pool, base in sidecar.cfg.upstreams.items():
            try:
                r = await sidecar.client.get(base.rstrip("/") + "/v1/models", headers=headers)
            except httpx.HTTPError:
                continue
            if r.status_code < 500:
                return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return _error(502, "no upstream pool answered /v1/models", "upstream_error", "upstream_unreachable")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(sidecar.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        pools = sidecar.scraper.health()
        ready = any(p["up"] for p in pools.values()) if pools else False
        live = sidecar.router.live
        body = {"ready": ready, "engine": sidecar.cfg.engine, "pools": pools,
                "fallback_enforceable": not sidecar.router.single,
                "policy": live.status() if live is not None else {"source": "file", "live": False}}
        if sidecar.router.single:
            body["note"] = ("one engine pool only: class fallbacks are reported and alerted on, "
                            "but cannot be enforced (add a plain pool to enforce them)")
        return JSONResponse(body, status_code=200 if ready else 503)

    return app


async def _send(client: httpx.AsyncClient, url: str, raw: bytes, headers: dict[str, str],
                stream: bool) -> tuple[str | None, str, Any]:
    """(failure kind or None, detail, response)."""
    try:
        req = client.build_request("POST", url, content=raw, headers=headers)
        resp = await client.send(req, stream=True)
        if not stream:
            try:
                await resp.aread()
            finally:
                await resp.aclose()
        return None, "", resp
    except (httpx.ConnectTimeout, httpx.PoolTimeout):
        return "unreachable", "could not be connected to in time", None
    except httpx.TimeoutException:
        return "timeout", "did not answer in time", None
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return "unreachable", f"is unreachable ({type(exc).__name__})", None
    except httpx.HTTPError as exc:
        return "unreachable", f"failed ({type(exc).__name__})", None


async def _relay(sidecar: Sidecar, resp: httpx.Response, route: Route, pool: str, spec_pool: bool,
                 started: float):
    """Pass the upstream's bytes on as they come, timing the events (see `_StreamWatcher`)."""
    watcher = _StreamWatcher(sidecar.cfg.engine, started)

    def _sse_error(message: str, code: str) -> bytes:
        # a partial event the engine left unfinished is closed first, so the error is its own event
        sep = b"\n\n" if watcher.buffer.strip() else b""
        return sep + b"data: " + json.dumps(error_body(message, "upstream_error", code)).encode() + b"\n\n"

    deadline = started + sidecar.cfg.request_timeout_s
    outcome = "ok"
    try:
        async for data in resp.aiter_raw():
            now = time.monotonic()
            watcher.feed(data, now)
            yield data
            if now > deadline:
                outcome = "timeout"
                yield _sse_error(f"upstream pool {pool!r} passed the request deadline "
                                 f"({sidecar.cfg.request_timeout_s:g}s)", "upstream_timeout")
                break
        else:
            if not watcher.done:
                outcome = "truncated"
                yield _sse_error(f"upstream pool {pool!r} ended the stream without [DONE]", "upstream_truncated")
    except httpx.TimeoutException:
        outcome = "timeout"
        yield _sse_error(f"upstream pool {pool!r} sent nothing for {sidecar.cfg.read_timeout_s:g}s",
                         "upstream_timeout")
    except httpx.HTTPError as exc:
        outcome = "truncated"
        yield _sse_error(f"upstream pool {pool!r} broke the stream ({type(exc).__name__})", "upstream_truncated")
    finally:
        await resp.aclose()
        if outcome != "ok":
            sidecar.metrics.upstream_errors.labels(pool, outcome).inc()
        if watcher.malformed:
            sidecar.metrics.upstream_errors.labels(pool, "malformed").inc(watcher.malformed)
        sidecar.metrics.requests.labels(pool, route.request_class, outcome).inc()
        end = watcher.last if watcher.last is not None else time.monotonic()
        obs = Observation(pool, spec_pool, end - started,
                          ttft_s=None if watcher.first is None else watcher.first - started,
                          decode_s=None if watcher.first is None else (watcher.last - watcher.first),
                          gaps_s=watcher.gaps, chunks=watcher.chunks, usage_tokens=watcher.usage,
                          counts=watcher.counts)
        if outcome == "ok":
            sidecar.account(route, obs)
