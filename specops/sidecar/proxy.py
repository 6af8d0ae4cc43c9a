"""The sidecar's HTTP side: an OpenAI-compatible reverse proxy that routes by request class.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE passed
through byte for byte as the engine sends it), ``GET /v1/models`` (from the first
pool that answers), ``GET /metrics``, ``GET /healthz`` (also as ``GET /health``),
``GET /readyz``.

Per request: classify and pick a pool (`Router`: dict lookups over the last good
policy state, never Redis), forward the body unchanged, time the stream (TTFT, chunk
gaps) while passing its bytes on (`StreamWatcher`), read the engine's speculation
fields (`fields.extract`) and account a `DecodeRecord` (`telemetry`; Redis writes are
buffered and flushed by the background task). Responses carry ``x-specops-class`` and
``x-specops-pool`` headers.

The request path is kept short because it adds to every request's time to first token
(issue budget: ≤ 2 ms p50 / ≤ 5 ms p99 TTFT, ≤ 0.5 ms per chunk; ``specops bench
sidecar`` measures it): the two proxied routes are plain ASGI (no FastAPI routing,
middleware or response classes; the other routes are a FastAPI app behind them), the
engines are reached through pooled keep-alive connections (`upstream.UpstreamClient`:
one write per request, no per-request connection or name lookup), and chunks are
relayed as they arrive with only a byte search per event (`StreamWatcher`): one write
to the client per read from the engine (the chunks that arrived together go on
together), the last one carrying the end of the response when the engine's end came
with it, and one read-watchdog timer per stream instead of a timeout per read. The
HTTP server side is uvicorn's (no proxy-headers middleware): with ``uvloop`` and
``httptools`` installed it uses them (measured with a fake engine: sidecar CPU per
17-chunk stream 1.4 → 0.9 ms); they are not dependencies of the light install, so
without them it runs on asyncio and h11.

What is left per chunk is mostly the kernel's: one read, one write, one wake-up
(``python -m tests.sidecar.cpu_probe`` measures the sidecar process's CPU per request
and per chunk against a fake engine; ``--compare`` another source tree in alternating
rounds). December 2026, 2 shared cores at load ≈ 8, concurrency 1: 0.123 → 0.094 ms
per chunk and 0.50 → 0.40 ms per request (of which py-spy puts about a third in the
client socket's write and most of the rest in the event loop's own C code).

Failure handling (nothing hangs: every upstream call has a connect and a per-read
timeout, and a stream a total deadline):
- a client mistake (bad JSON, body not an object, over 4 MiB) → 4xx in OpenAI's shape;
- the pool cannot be reached or answers 502-504 → the other pool when the policy's
  ``upstreams.failover`` allows, else 502 in OpenAI's shape; no answer within the
  read timeout → 504 at once (the engine may still be running it: no second copy);
- a non-JSON 200 body → 502 ``upstream_malformed``;
- a stream that breaks, stalls past the read timeout or passes the deadline → an
  SSE ``data: {"error": ...}`` event, then the stream ends (the status line is gone);
- the client goes away mid-stream → the engine connection is closed at the next chunk
  (the engine aborts the request), and the request is counted ``client_gone``.
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
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge

from specops.sidecar import fields
from specops.sidecar.routing import Route, Router
from specops.sidecar.scrape import EngineScraper
from specops.sidecar.stream import StreamWatcher
from specops.sidecar.telemetry import Observation, PoolSpeed, to_record
from specops.sidecar.upstream import UpstreamClient, UpstreamError, UpstreamResponse
from specops.webstack import metrics_response

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
LABEL_HEADER = "x-specops-label-"
ROUTING_HEADER = "x-specops-routing-key"
FORWARD_HEADERS = frozenset(("authorization", "content-type", "accept", "x-request-id", "openai-organization"))
RETRY_STATUS = (502, 503, 504)
PROXIED = frozenset(("/v1/completions", "/v1/chat/completions"))


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


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
        self.records_by = "sidecar" if records is not None else "none"   # who writes the Redis records
        self.speed = speed or PoolSpeed()
        self.metrics = SidecarMetrics(registry)
        self.metrics.unenforceable.set(1 if router.single else 0)
        self.scraper = EngineScraper(cfg.engine, cfg.upstreams, registry=registry)
        self.client: httpx.AsyncClient | None = None       # /metrics scrapes and /v1/models (off the request path)
        self.upstream = UpstreamClient(cfg.upstreams, connect_timeout_s=cfg.connect_timeout_s,
                                       read_timeout_s=cfg.read_timeout_s)  # the proxied requests

    def timeout(self) -> httpx.Timeout:
        c = self.cfg
        return httpx.Timeout(connect=c.connect_timeout_s, read=c.read_timeout_s, write=c.read_timeout_s,
                             pool=c.connect_timeout_s)

    # -- telemetry ---------------------------------------------------------------------
    def account(self, route: Route, obs: Observation) -> None:
        plain_pool = self.router.pool_name(self.router.upstreams.plain)
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


def _labels_and_key(headers: dict[str, str], body: dict[str, Any]) -> tuple[dict[str, str], str | None]:
    meta = body.get("metadata")
    labels = {str(k): v for k, v in meta.items() if isinstance(v, str)} if isinstance(meta, dict) else {}
    for name, value in headers.items():
        if name.startswith(LABEL_HEADER):
            labels[name[len(LABEL_HEADER):]] = value
    key = headers.get(ROUTING_HEADER)
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


def _header_list(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def _reply(send, status: int, body: bytes, headers: dict[str, str] | None = None,
                 content_type: str | None = "application/json") -> None:
    out = dict(headers or {})
    if content_type:
        out["content-type"] = content_type
    out["content-length"] = str(len(body))
    await send({"type": "http.response.start", "status": status, "headers": _header_list(out)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _reply_error(send, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                       headers: dict[str, str] | None = None) -> None:
    await _reply(send, status, json.dumps(error_body(message, type_, code)).encode(), headers)


def _sse_error(message: str, code: str, partial: bool) -> bytes:
    # a partial event the engine left unfinished is closed first, so the error is its own event
    return (b"\n\n" if partial else b"") + b"data: " + json.dumps(error_body(message, "upstream_error", code)).encode() \
        + b"\n\n"


class ProxyApp:
    """ASGI entry: the two proxied routes handled here, everything else (and lifespan) by ``app``."""

    def __init__(self, sidecar: Sidecar, app: FastAPI) -> None:
        self.sidecar = sidecar
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in PROXIED:
            if scope["method"] != "POST":
                await _reply_error(send, 405, "method not allowed", headers={"allow": "POST"})
                return
            await self.proxy(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def proxy(self, scope, receive, send) -> None:
        sidecar = self.sidecar
        path = scope["path"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return await _reply_error(send, 413, f"request body over {MAX_BODY_BYTES} bytes")
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            part = message.get("body", b"")
            size += len(part)
            if size > MAX_BODY_BYTES:
                return await _reply_error(send, 413, f"request body over {MAX_BODY_BYTES} bytes")
            parts.append(part)
            if not message.get("more_body"):
                break
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        try:
            body = json.loads(raw)
        except ValueError:
            return await _reply_error(send, 400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return await _reply_error(send, 400, "request body must be a JSON object")
        labels, key = _labels_and_key(headers, body)
        temperature = body.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
            temperature = 1.0  # the engine answers the client's mistake itself
        route = sidecar.router.route(_prompt_text(path, body), labels=labels, routing_key=key,
                                     temperature=float(temperature))
        stream = body.get("stream") is True
        forward = {k: v for k, v in headers.items() if k in FORWARD_HEADERS or k.startswith("x-specops-")}
        forward.setdefault("content-type", "application/json")
        started = time.monotonic()
        pool = route.pool
        tried: list[str] = []
        while True:
            tried.append(pool)
            kind, detail, resp, content = await _send(sidecar.upstream, pool, path, raw, forward, stream)
            last_bad = None
            if kind is None and resp.status in RETRY_STATUS:
                kind, detail = f"http_{resp.status}", f"answered {resp.status}"
                if content is None:
                    try:
                        content = await resp.body()
                    except UpstreamError:
                        content = b""
                last_bad = (resp.status, content, resp.headers.get("content-type", ""))
                resp.release()
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
                return await _reply(send, status, content, content_type=ctype or None)
            status = 504 if kind == "timeout" else 502
            return await _reply_error(send, status, f"upstream pool {pool!r} {detail}", "upstream_error",
                                      f"upstream_{kind}")
        if pool != route.pool:
            route = sidecar.router.with_pool(route, pool)
        out_headers = {"x-specops-class": route.request_class, "x-specops-pool": pool}
        if route.probe:
            out_headers["x-specops-probe"] = "1"
        ctype = resp.headers.get("content-type")
        if content is not None:  # not streamed, or the engine's own error (4xx: the client's mistake): as is
            resp.release()
            if resp.status != 200:
                sidecar.metrics.requests.labels(pool, route.request_class, f"http_{resp.status}").inc()
                return await _reply(send, resp.status, content, out_headers, ctype)
            return await self.answer(send, route, pool, content, ctype, out_headers, started)
        await self.relay(receive, send, resp, route, pool, ctype, out_headers, started)

    async def answer(self, send, route: Route, pool: str, content: bytes, ctype: str | None,
                     out_headers: dict[str, str], started: float) -> None:
        sidecar = self.sidecar
        try:
            data = json.loads(content)
        except ValueError:
            sidecar.metrics.upstream_errors.labels(pool, "malformed").inc()
            sidecar.metrics.requests.labels(pool, route.request_class, "upstream_error").inc()
            return await _reply_error(send, 502, f"upstream pool {pool!r} returned a body that is not JSON",
                                      "upstream_error", "upstream_malformed", headers=out_headers)
        await _reply(send, 200, content, out_headers, ctype or "application/json")
        obs = Observation(pool, route.spec_pool, time.monotonic() - started, usage_tokens=fields.completion_tokens(data),
                          counts=fields.extract(sidecar.cfg.engine, data))
        if obs.usage_tokens is None and isinstance(data, dict):
            obs.chunks = 1 if _has_content(data) else 0
        sidecar.account(route, obs)
        sidecar.metrics.requests.labels(pool, route.request_class, "ok").inc()

    async def relay(self, receive, send, resp: UpstreamResponse, route: Route, pool: str, ctype: str | None,
                    out_headers: dict[str, str], started: float) -> None:
        """Pass the engine's bytes on as they come, timing the events (see `StreamWatcher`)."""
        sidecar = self.sidecar
        cfg = sidecar.cfg
        watcher = StreamWatcher(cfg.engine, started)
        deadline = started + cfg.request_timeout_s
        outcome = "ok"
        ended = False
        gone = asyncio.ensure_future(receive())  # resolves with http.disconnect when the client leaves
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": _header_list(dict(out_headers, **{"content-type": ctype or "text/event-stream"}))})
            try:
                async for data in resp.chunks():
                    now = time.monotonic()
                    watcher.feed(data, now)
                    if resp.complete and watcher.done:
                        # the engine's body ended with these bytes: so does ours, in the same write
                        await send({"type": "http.response.body", "body": data, "more_body": False})
                        ended = True
                        continue
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    if gone.done():
                        if gone.cancelled() or gone.exception() or gone.result()["type"] == "http.disconnect":
                            outcome = "client_gone"
                            break
                        gone = asyncio.ensure_future(receive())  # not a disconnect: keep listening
                    if now > deadline:
                        outcome = "timeout"
                        await send({"type": "http.response.body", "more_body": True, "body": _sse_error(
                            f"upstream pool {pool!r} passed the request deadline ({cfg.request_timeout_s:g}s)",
                            "upstream_timeout", bool(watcher.buffer.strip()))})
                        break
                else:
                    if not watcher.done:
                        outcome = "truncated"
                        await send({"type": "http.response.body", "more_body": True, "body": _sse_error(
                            f"upstream pool {pool!r} ended the stream without [DONE]", "upstream_truncated",
                            bool(watcher.buffer.strip()))})
            except UpstreamError as exc:
                outcome = exc.kind
                message = (f"upstream pool {pool!r} sent nothing for {cfg.read_timeout_s:g}s" if exc.kind == "timeout"
                           else f"upstream pool {pool!r} broke the stream ({exc.detail})")
                await send({"type": "http.response.body", "more_body": True,
                            "body": _sse_error(message, f"upstream_{exc.kind}", bool(watcher.buffer.strip()))})
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            resp.release()  # back to the pool when read to its end, else closed (the engine aborts)
            gone.cancel()
            self.finish(route, pool, watcher, outcome, started)

    def finish(self, route: Route, pool: str, watcher: StreamWatcher, outcome: str, started: float) -> None:
        sidecar = self.sidecar
        if outcome not in ("ok", "client_gone"):
            sidecar.metrics.upstream_errors.labels(pool, outcome).inc()
        if watcher.malformed:
            sidecar.metrics.upstream_errors.labels(pool, "malformed").inc(watcher.malformed)
        end = watcher.last if watcher.last is not None else time.monotonic()
        obs = Observation(pool, route.spec_pool, end - started,
                          ttft_s=None if watcher.first is None else watcher.first - started,
                          decode_s=None if watcher.first is None else (watcher.last - watcher.first),
                          gaps_s=watcher.gaps, chunks=watcher.chunks, usage_tokens=watcher.usage,
                          counts=watcher.counts)
        if outcome == "ok":
            sidecar.account(route, obs)
        sidecar.metrics.requests.labels(pool, route.request_class, outcome).inc()


async def _send(client: UpstreamClient, pool: str, path: str, raw: bytes, headers: dict[str, str],
                stream: bool) -> tuple[str | None, str, UpstreamResponse | None, bytes | None]:
    """(failure kind or None, detail, response, its body when not streamed)."""
    try:
        resp = await client.request(pool, "POST", path, raw, headers)
    except UpstreamError as exc:
        return exc.kind, exc.detail, None, None
    if stream and resp.status == 200:
        return None, "", resp, None
    try:
        content = await resp.body()
    except UpstreamError as exc:
        resp.release()
        kind = "timeout" if exc.kind == "timeout" else "unreachable"
        return kind, exc.detail, None, None
    return None, "", resp, content


def build_app(sidecar: Sidecar) -> ProxyApp:
    """The ASGI app around one `Sidecar` (proxied routes in `ProxyApp`, the rest in FastAPI)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sidecar.client = httpx.AsyncClient(timeout=sidecar.timeout(),
                                           limits=httpx.Limits(max_connections=64, max_keepalive_connections=8))
        await sidecar.scraper.scrape(sidecar.client)  # /readyz knows the pools from the start
        task = asyncio.create_task(sidecar.background())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if sidecar.records is not None:  # what waited for the next flush (`RecordBuffer.min_interval_s`)
                try:
                    await asyncio.to_thread(sidecar.records.flush, True)
                except Exception:  # Redis down at exit: the records stay counted as buffered, never raised
                    log.exception("final telemetry flush failed")
            sidecar.upstream.close()
            await sidecar.client.aclose()

    app = FastAPI(title="specops sidecar", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}
        for pool, base in sidecar.cfg.upstreams.items():
            try:
                r = await sidecar.client.get(base.rstrip("/") + "/v1/models", headers=headers)
            except httpx.HTTPError:
                continue
            if r.status_code < 500:
                return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return JSONResponse(error_body("no upstream pool answered /v1/models", "upstream_error",
                                       "upstream_unreachable"), status_code=502)

    @app.get("/metrics")
    async def metrics() -> Response:
        return metrics_response(sidecar.registry)

    @app.get("/health")  # the name vLLM, SGLang and llama-server answer, and load generators probe
    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        pools = sidecar.scraper.health()
        ready = any(p["up"] for p in pools.values()) if pools else False
        live = sidecar.router.live
        body = {"ready": ready, "engine": sidecar.cfg.engine, "pools": pools, "records_by": sidecar.records_by,
                "fallback_enforceable": not sidecar.router.single,
                "policy": live.status() if live is not None else {"source": "file", "live": False}}
        if sidecar.router.single:
            body["note"] = ("one engine pool only: class fallbacks are reported and alerted on, "
                            "but cannot be enforced (add a plain pool to enforce them)")
        return JSONResponse(body, status_code=200 if ready else 503)

    return ProxyApp(sidecar, app)
