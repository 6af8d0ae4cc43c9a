"""The runtimes' fail-static view of the policy state in Redis.

`LivePolicy` keeps the last good copy of everything a request needs — the stable
revision, the rollout state, the per-class `EffectiveSettings` and the policies by
revision — so resolving a request never touches Redis. `poll()` (called by a
background thread in the server and the sidecar, between requests in the in-process
path) drains the store's change notifications and reconciles every ``reconcile_s`` (a
missed notification only delays a change, never loses it); when Redis fails, the next
attempt waits out `BACKOFF_S` (one attempt per step, never redis-py's retries), and
when Redis answers with no policy at all (data loss, FLUSHALL) the last good values
stay in force. `stale` / `stale_reason` say so, for ``/readyz`` and the
``specops_serving_policy_stale`` gauge. It reads the state through `PolicyStore` only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from specops.policies.errors import PolicyError, StateError, StoreUnavailableError
from specops.policies.schema import Policy
from specops.policies.state import EffectiveSettings, RolloutState

log = logging.getLogger(__name__)

#: seconds to wait before the next Redis attempt after 1, 2, 3, ... consecutive failures
BACKOFF_S: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 5.0)

STALE_UNREACHABLE = "redis_unreachable"
STALE_EMPTY = "redis_empty"
STALE_NEVER_LOADED = "never_loaded"

_FAILURES = (StoreUnavailableError, redis.RedisError, OSError)


def serving_redis(url: str | None = None, *, unix_socket_path: str | None = None, timeout_s: float = 0.5) -> redis.Redis:
    """A client for the serving path: short socket timeouts and no retries.

    redis-py's default retry policy re-tries each command (with backoff) on a dead
    connection, which turned one poll into seconds of stall; the serving path does
    its own backoff (`BACKOFF_S`) instead. ``redis+sentinel://`` / ``redis+cluster://``
    URLs get the same short timeouts through `specops.policies.redis_urls` (their
    failover handling needs redis-py's own reconnects, so retries stay on there).
    """
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    common: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                              "retry": Retry(NoBackoff(), 0), "retry_on_timeout": False}
    if url:
        from specops.policies import redis_urls

        scheme = url.split("://", 1)[0].lower()
        if scheme in redis_urls.SENTINEL_SCHEMES:  # the primary the sentinels name, re-asked on failure
            return redis_urls.sentinel_client(redis_urls.parse(url), timeout_s)
        if scheme in redis_urls.CLUSTER_SCHEMES:
            return redis_urls.cluster_client(redis_urls.parse(url), timeout_s)
        return redis.Redis.from_url(url, **common)
    if unix_socket_path:
        return redis.Redis(unix_socket_path=unix_socket_path, **common)
    raise ValueError("serving_redis needs a URL or a unix socket path")


@dataclass
class Snapshot:
    """The policy state one refresh read (all or nothing)."""

    stable: int | None
    rollout: RolloutState | None
    effective: dict[str, EffectiveSettings]
    policies: dict[int, Policy] = field(default_factory=dict)


class LivePolicy:
    """Last good policy state from a `PolicyStore`, refreshed with backoff (see module docstring)."""

    def __init__(self, store: Any, *, reconcile_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 backoff_s: tuple[float, ...] = BACKOFF_S, subscribe: bool = True) -> None:
        if not reconcile_s > 0:
            raise ValueError(f"reconcile_s must be > 0, got {reconcile_s!r}")
        if not backoff_s or any(b <= 0 for b in backoff_s):
            raise ValueError("backoff_s must be a non-empty sequence of positive seconds")
        self.store = store
        self.reconcile_s = reconcile_s
        self.clock = clock
        self.backoff_s = tuple(backoff_s)
        self.subscribe = subscribe
        self.reloads = 0
        self.failures = 0                # consecutive failed attempts
        self.failures_total = 0
        self.stale_reason: str | None = STALE_NEVER_LOADED
        self.last_error: str = ""
        self._snap = Snapshot(None, None, {})
        self._loaded_at: float | None = None
        self._next_attempt = float("-inf")
        self._pubsub: Any = None
        self._lock = threading.Lock()     # poll() may run on a thread while requests read
        self.poll(force=True)

    # -- reads (never touch Redis) ------------------------------------------------------
    @property
    def stale(self) -> bool:
        return self.stale_reason is not None

    @property
    def stable_revision(self) -> int | None:
        return self._snap.stable

    @property
    def rollout(self) -> RolloutState | None:
        return self._snap.rollout

    def settings_for(self, request_class: str) -> EffectiveSettings | None:
        return self._snap.effective.get(request_class)

    @property
    def settings(self) -> dict[str, EffectiveSettings]:
        return dict(self._snap.effective)

    def policy(self, revision: int) -> Policy | None:
        return self._snap.policies.get(revision)

    def age_s(self) -> float | None:
        """Seconds since the last successful load (None before the first)."""
        return None if self._loaded_at is None else max(0.0, self.clock() - self._loaded_at)

    def status(self) -> dict[str, Any]:
        """What ``/readyz`` shows about the policy state."""
        snap = self._snap
        age = self.age_s()
        return {
            "source": "redis",
            "live": not self.stale,
            "stale_reason": self.stale_reason,
            "last_error": self.last_error or None,
            "age_s": None if age is None else round(age, 3),
            "revision": snap.stable,
            "canary": ({"revision": snap.rollout.revision, "phase": snap.rollout.phase, "weight": snap.rollout.weight}
                       if snap.rollout is not None and snap.rollout.active else None),
            "classes": {name: {"method": s.method, "gamma": s.gamma, "medusa_heads": s.medusa_heads,
                               "fallback": s.fallback_active, "revision": s.revision}
                        for name, s in sorted(snap.effective.items())},
        }

    # -- refresh ------------------------------------------------------------------------
    def poll(self, force: bool = False) -> bool:
        """Reload when notified, when the reconcile period passed, or with ``force``; True when reloaded.

        During backoff after a failure this returns at once without touching Redis.
        """
        with self._lock:
            now = self.clock()
            if now < self._next_attempt and not force:
                return False
            notified = self._drain()
            due = self._loaded_at is None or now - self._loaded_at >= self.reconcile_s or self.stale
            if not (notified or due or force):
                return False
            return self._reload()

    def close(self) -> None:
        with self._lock:
            self._close_pubsub()

    def _close_pubsub(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except _FAILURES:
                pass
            self._pubsub = None

    def _drain(self) -> bool:
        """Consume pending notifications without blocking; True if any arrived (or we just resubscribed)."""
        if not self.subscribe:
            return False
        if self._pubsub is None:
            try:
                pubsub = self.store.subscribe()
                self._pubsub = pubsub
            except _FAILURES as exc:
                log.debug("cannot subscribe to %s: %s", self.store.channel, exc)
                return False
            return True  # changes may have been missed while unsubscribed
        notified = False
        try:
            while True:
                message = self._pubsub.get_message(timeout=0)
                if message is None:
                    break
                notified = notified or message.get("type") == "message"
        except _FAILURES as exc:
            log.warning("lost the settings channel: %s", exc)
            self._close_pubsub()
            return True
        return notified

    def _read(self) -> Snapshot:
        stable, rollout, effective = self.store.live_view()
        policies = dict(self._snap.policies)
        wanted = {stable} | ({rollout.revision} if rollout is not None and rollout.active else set())
        for rev in sorted(w for w in wanted if w is not None and w not in policies):
            policies[rev] = self.store.get_revision(rev).policy
        return Snapshot(stable, rollout, effective, policies)

    def _reload(self) -> bool:
        try:
            snap = self._read()
        except (*_FAILURES, StateError, PolicyError, ValueError) as exc:
            self.failures += 1
            self.failures_total += 1
            delay = self.backoff_s[min(self.failures, len(self.backoff_s)) - 1]
            self._next_attempt = self.clock() + delay
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            self.stale_reason = STALE_UNREACHABLE
            log.warning("policy state not refreshed (attempt %d, next in %.2fs), serving the last known "
                        "settings: %s", self.failures, delay, self.last_error)
            self._close_pubsub()
            return False
        self.failures = 0
        self._next_attempt = float("-inf")
        if snap.stable is None or not snap.effective:
            # Redis answered but holds no policy (restarted without data, FLUSHALL, failover to an
            # empty replica): keep serving what we had; a controller or operator re-seeds it.
            self.stale_reason = STALE_EMPTY if self._snap.stable is not None else STALE_NEVER_LOADED
            self.last_error = "Redis holds no current policy revision / settings"
            if self._snap.stable is None:  # nothing better to keep: take what there is
                self._snap = Snapshot(snap.stable, snap.rollout, snap.effective, snap.policies)
            return False
        self._snap = snap
        self._loaded_at = self.clock()
        self.stale_reason = None
        self.last_error = ""
        self.reloads += 1
        return True
