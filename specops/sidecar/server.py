"""Wiring of ``specops sidecar``: policy file, Redis (fail-static), telemetry sinks, router, uvicorn.

Torch-free by contract (import-linter "Ops layer stays light"): it imports the
policy, telemetry and `specops.policies.live` modules, never the engine.

Who writes a request's `DecodeRecord` to Redis (``--records``) — exactly one writer
per request, so the controller's windows count each request once:

``auto`` (default)
    the *engine* when it is ``specops serve`` (``--engine specops``): it records every
    request itself, under the same contract, with what it actually ran (its method, γ,
    policy revision and canary pick, its own speed-up estimate), into the namespace it
    was started with; the sidecar writes none. For vLLM / SGLang / llama.cpp pools, which
    record nothing in Redis, the sidecar writes them (from their response fields).
``on``
    the sidecar always writes; for ``specops serve`` pools that are started with
    namespaces of their own (``--namespace <ns>-pool-<name>``, which the controller
    does not read): the sidecar's records then carry its routing decisions
    (``policy_fallback`` when it moved a class to the plain pool, probes, its canary pick).
``off``
    the sidecar never writes (its ``/metrics`` still exports the per-class families).

Pools that share the controller's namespace with ``--records on`` would count twice;
that is the configuration ``auto`` exists to avoid.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class SidecarError(RuntimeError):
    """The sidecar cannot start (one readable line)."""


@dataclass
class SidecarOptions:
    engine: str
    upstreams: dict[str, str]
    policy_file: str
    redis_url: str | None = None
    namespace: str = "specops"
    pod: str | None = None
    host: str = "127.0.0.1"
    port: int = 9400
    reconcile_s: float = 5.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    scrape_s: float = 5.0
    log_level: str = "info"
    records: str = "auto"           # auto | on | off: who writes the Redis records (module docstring)
    extra: dict[str, Any] = field(default_factory=dict)


RECORDS = ("auto", "on", "off")


def sidecar_writes_records(records: str, engine: str) -> bool:
    """Whether the sidecar, not the engine, writes the Redis records (see the module docstring)."""
    if records not in RECORDS:
        raise SidecarError(f"--records must be one of {', '.join(RECORDS)}, got {records!r}")
    return records == "on" or (records == "auto" and engine != "specops")


def _bootstrap(url: str, namespace: str, policy: Any, text: str) -> None:
    """Store the policy file as the first revision when Redis has none (as ``serve`` does)."""
    from specops.policies import rollout as machine
    from specops.policies.errors import ConflictError, StateError, StoreUnavailableError
    from specops.policies.redis_backend import close, connect
    from specops.policies.store import PolicyStore

    try:
        admin = connect(url)
    except StoreUnavailableError as exc:
        log.warning("%s; routing with the policy file until Redis is reachable", exc)
        return
    try:
        store = PolicyStore(admin, namespace=namespace)
        if store.current_revision() is None:
            machine.start_rollout(store, policy, text, actor="sidecar-bootstrap")
            log.info("stored the policy file %s as the current revision", policy.version)
    except ConflictError:
        log.info("another process stored the first policy; using it")
    except (StateError, StoreUnavailableError) as exc:
        log.warning("policy file not stored: %s", exc)
    finally:
        close(admin)


def build_sidecar(opts: SidecarOptions, registry: Any = None) -> Any:
    """The `Sidecar` for ``opts`` (no server started); raises `SidecarError`."""
    from prometheus_client import CollectorRegistry

    from specops.controller.rollout_driver import canary_namespace
    from specops.policies import PolicyError, load_policy
    from specops.policies.loader import read_source
    from specops.policies.store import PolicyStore
    from specops.policies.live import LivePolicy, serving_redis
    from specops.telemetry.record_buffer import RECORD_FLUSH_S, RecordBuffer
    from specops.sidecar.proxy import Sidecar, SidecarConfig
    from specops.sidecar.routing import Router
    from specops.telemetry.exporter import PrometheusExporter
    from specops.telemetry.redis_metrics import RedisPublisher

    try:
        policy = load_policy(opts.policy_file)
        text, _ = read_source(opts.policy_file)
    except (PolicyError, OSError) as exc:
        raise SidecarError(f"{opts.policy_file}: {exc}") from None
    registry = registry if registry is not None else CollectorRegistry()
    live = records = None
    writes = sidecar_writes_records(opts.records, opts.engine)
    if opts.redis_url:
        _bootstrap(opts.redis_url, opts.namespace, policy, text)
        client = serving_redis(opts.redis_url)
        live = LivePolicy(PolicyStore(client, namespace=opts.namespace), reconcile_s=opts.reconcile_s)
        pod = opts.pod or f"{socket.gethostname()}-{os.getpid()}"
        if writes:
            records = RecordBuffer(RedisPublisher(client, pod=pod, namespace=opts.namespace),
                                   RedisPublisher(client, pod=pod, namespace=canary_namespace(opts.namespace)),
                                   min_interval_s=RECORD_FLUSH_S)
        log.info("per-request records in Redis: written by %s (--records %s)",
                 "the sidecar" if writes else "the specops engine pools", opts.records)
    try:
        router = Router(policy, opts.upstreams, live=live)
    except ValueError as exc:
        raise SidecarError(str(exc)) from None
    cfg = SidecarConfig(engine=opts.engine, upstreams=opts.upstreams, connect_timeout_s=opts.connect_timeout_s,
                        read_timeout_s=opts.read_timeout_s, request_timeout_s=opts.request_timeout_s,
                        poll_s=0.2, scrape_s=opts.scrape_s)
    try:
        sidecar = Sidecar(cfg, router, registry=registry, exporter=PrometheusExporter(registry), records=records)
    except ValueError as exc:
        raise SidecarError(str(exc)) from None
    sidecar.records_by = ("sidecar" if writes else "engine") if opts.redis_url else "none"
    if router.single:
        log.warning("one engine pool only (%s): class fallbacks will be reported and alerted on but cannot be "
                    "enforced; give a plain pool with --upstream to enforce them", ", ".join(opts.upstreams))
    else:
        u = router.upstreams
        log.info("pools: spec=%s plain=%s (failover %s)", u.spec, u.plain, "on" if u.failover else "off")
    return sidecar


def run_sidecar(opts: SidecarOptions) -> None:
    """Serve until SIGINT / SIGTERM."""
    import uvicorn

    from specops.sidecar.proxy import build_app
    from specops.webstack import serve_until_signal, server_config

    sidecar = build_sidecar(opts)
    app = build_app(sidecar)
    try:
        serve_until_signal(uvicorn.Server(server_config(app, host=opts.host, port=opts.port, log_level=opts.log_level)))
    finally:
        live = sidecar.router.live
        if live is not None:
            live.close()
