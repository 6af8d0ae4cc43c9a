"""Wiring of ``specops serve``: Redis (given or embedded), the bootstrap policy, the models, uvicorn.

Two Redis clients: an admin one (startup: the embedded server's lifecycle, storing
the bootstrap policy when the store has none, exactly as ``controller run`` does) and
the serving one (`serving_redis`: short timeouts, no retries) that the fail-static
`LivePolicy` and the telemetry publishers use. Started with no arguments it uses the
bundled models, ``examples/policies/default.yaml`` and an embedded Redis in
``.specops/`` — the same one a ``specops controller run`` started in the same
directory shares.

When the engine thread fails (see `specops.engine.async_engine`), the requests in
flight are answered with errors, ``/readyz`` turns 503, and the server shuts down:
`run_server` raises `ServeError` and ``specops serve`` exits non-zero, for a
supervisor to start a fresh process (the failed engine's state is not trusted).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_POLICY = Path(__file__).resolve().parent.parent.parent / "examples" / "policies" / "default.yaml"
BLOCK_SIZE = 16


class ServeError(RuntimeError):
    """The server cannot start (one readable line)."""


SERVE_DTYPES = ("float32", "bfloat16")  # the torch dtypes `specops serve --dtype` loads models with


@dataclass
class ServeConfig:
    model: str = "bundled"
    draft: str | None = None
    medusa: str | None = None
    eagle: str | None = None  # EAGLE drafter folder (method eagle)
    policy_file: str | None = None
    redis_url: str | None = None
    state_dir: str = ".specops"
    namespace: str = "specops"
    pod: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 16
    max_queue: int = 256
    kv_cache_mb: float | None = None  # None: `kv_budget.choose_kv_budget` (model, batch and free memory)
    api_key: str | None = None
    served_model_name: str | None = None
    reconcile_s: float = 5.0
    threads: int | None = None
    dtype: str = "float32"  # "float32" | "bfloat16": the weights the models load with
    log_level: str = "info"


def _open_redis(cfg: ServeConfig) -> tuple[Any, Any]:
    """(admin client or None, serving client)."""
    from specops.policies.errors import StoreUnavailableError
    from specops.policies.redis_backend import connect
    from specops.policies.live import serving_redis

    if cfg.redis_url:
        try:
            admin = connect(cfg.redis_url)
        except StoreUnavailableError as exc:
            if "refused us" in str(exc) or "unsupported" in str(exc):
                raise ServeError(str(exc)) from None
            log.warning("%s; serving with the bootstrap policy until it is reachable", exc)
            admin = None
        return admin, serving_redis(cfg.redis_url)
    try:
        admin = connect(None, cfg.state_dir)
    except StoreUnavailableError as exc:
        raise ServeError(str(exc)) from None
    return admin, serving_redis(unix_socket_path=admin.socket_file)


def _bootstrap(admin: Any, namespace: str, policy: Any, text: str, source: str | None = None) -> None:
    """Store ``policy`` as the first revision when Redis has none. ``source``: the file the
    operator named with ``--policy`` (None: the default): when Redis already holds another
    policy, say that the file is not applied (rolling out is `specops policy rollout`'s job)."""
    from specops.policies import rollout as machine
    from specops.policies.errors import ConflictError, StateError, StoreUnavailableError
    from specops.policies.store import PolicyStore

    store = PolicyStore(admin, namespace=namespace)
    try:
        current = store.current_revision()
        if current is None:
            machine.start_rollout(store, policy, text, actor="serve-bootstrap")
            log.info("stored the bootstrap policy %s as the current revision", policy.version)
        elif source is not None:
            stored = store.get_revision(current)
            if stored.policy.version != policy.version:
                log.warning("--policy %s (version %s) is not applied: Redis already holds revision %s (version %s); "
                            "roll the file out with `specops policy rollout %s`, or start with an empty --state-dir",
                            source, policy.version, current, stored.policy.version, source)
    except ConflictError:
        log.info("another process stored the first policy; using it")
    except (StateError, StoreUnavailableError) as exc:
        log.warning("bootstrap policy not stored: %s", exc)


def build_engine_client(cfg: ServeConfig, serving_client: Any, policy: Any, registry: Any) -> Any:
    """Load the models and build the `AsyncEngine` (runs in a worker thread at startup)."""
    import torch

    from specops.controller.rollout_driver import canary_namespace
    from specops.decoder import Decoder
    from specops.models.heap import freeze_loaded
    from specops.policies.store import PolicyStore
    from specops.engine.async_engine import AsyncEngine, core_rule
    from specops.engine.engine import Engine
    from specops.policies.live import LivePolicy
    from specops.telemetry.record_buffer import RECORD_FLUSH_S, RecordBuffer
    from specops.engine.metrics import ServingMetrics
    from specops.engine.policy_runtime import PolicyRuntime
    from specops.telemetry.exporter import PrometheusExporter
    from specops.telemetry.redis_metrics import RedisPublisher

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    decoder = Decoder.from_pretrained(cfg.model, draft=cfg.draft, medusa=cfg.medusa, fallback=True, eagle=cfg.eagle,
                                      dtype=getattr(torch, cfg.dtype))
    if decoder.tokenizer is None:
        raise ServeError(f"no tokenizer found with the model {cfg.model!r}")
    engine = Engine(decoder, max_batch=cfg.max_batch, kv_cache_mb=cfg.kv_cache_mb, block_size=BLOCK_SIZE)
    frozen = freeze_loaded()  # full GC passes would stall every running request (specops.models.heap)
    log.info("models loaded; %d startup objects kept out of garbage collection", frozen)
    store = PolicyStore(serving_client, namespace=cfg.namespace)
    pod = cfg.pod or f"{socket.gethostname()}-{os.getpid()}"
    records = RecordBuffer(RedisPublisher(serving_client, pod=pod, namespace=cfg.namespace),
                           RedisPublisher(serving_client, pod=pod, namespace=canary_namespace(cfg.namespace)),
                           min_interval_s=RECORD_FLUSH_S)
    runtime = PolicyRuntime(decoder, policy, live=LivePolicy(store, reconcile_s=cfg.reconcile_s),
                            exporter=PrometheusExporter(registry), records=records)
    return AsyncEngine(engine, runtime, decoder.tokenizer, metrics=ServingMetrics(registry),
                       max_batch=cfg.max_batch, max_queue=cfg.max_queue, vocab_size=decoder.target.vocab_size,
                       threads=cfg.threads, http_core_from=core_rule(engine))


def run_server(cfg: ServeConfig) -> None:
    """Serve until SIGINT / SIGTERM; raises `ServeError` when it cannot start."""
    if cfg.dtype not in SERVE_DTYPES:
        raise ServeError(f"dtype must be one of {', '.join(SERVE_DTYPES)}, got {cfg.dtype!r}")
    import uvicorn
    from prometheus_client import CollectorRegistry, ProcessCollector

    from specops.policies import PolicyError, load_policy
    from specops.policies.loader import read_source
    from specops.policies.redis_backend import close
    from specops.server.app import build_app
    from specops.webstack import serve_until_signal, server_config

    policy_path = cfg.policy_file or str(DEFAULT_POLICY)
    try:
        policy = load_policy(policy_path)
        text, _ = read_source(policy_path)
    except (PolicyError, OSError) as exc:
        raise ServeError(f"{policy_path}: {exc}") from None
    admin, serving_client = _open_redis(cfg)
    failure: list[BaseException] = []
    engine_failure: list[str] = []
    server: uvicorn.Server | None = None
    try:
        if admin is not None:
            _bootstrap(admin, cfg.namespace, policy, text, source=cfg.policy_file)
        registry = CollectorRegistry()
        # process_cpu_seconds_total, process_resident_memory_bytes, ... (Linux): what serving costs the host,
        # read by `specops bench serve` per cell (CPU seconds per output token) and by operators' dashboards
        ProcessCollector(registry=registry)
        name = cfg.served_model_name or ("bundled" if cfg.model == "bundled" else Path(cfg.model).name)

        def on_load_error(exc: BaseException) -> None:
            failure.append(exc)
            if server is not None:
                server.should_exit = True

        def on_engine_failure(reason: str) -> None:  # the requests in flight are failed; shut down
            engine_failure.append(reason)
            if server is not None:
                server.should_exit = True

        app = build_app(lambda: build_engine_client(cfg, serving_client, policy, registry), model_name=name,
                        model_root=cfg.model, api_key=cfg.api_key, on_load_error=on_load_error,
                        on_engine_failure=on_engine_failure)
        server = uvicorn.Server(server_config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level))
        serve_until_signal(server)  # returns on SIGTERM too: the cleanup below stops the embedded Redis
    finally:
        try:
            serving_client.close()
        except Exception:  # closing a dead connection
            pass
        if admin is not None:
            admin.connection_pool.disconnect()  # idle pooled connections would count as other users
            close(admin)
    if failure:
        exc = failure[0]
        raise ServeError(f"cannot load the models: {type(exc).__name__}: {exc}")
    if engine_failure:
        raise ServeError(f"the engine failed: {engine_failure[0]}; exiting for a supervisor to restart the server")
