"""The serving path's fail-static view of the policy state in Redis, and its telemetry buffer.

`LivePolicy` keeps the last good copy of everything a request needs — the stable
revision, the rollout state, the per-class `EffectiveSettings` and the policies by
revision — so resolving a request never touches Redis. `poll()` (called by a
background thread in the server, between requests in the in-process path) drains
change notifications and reconciles every ``reconcile_s``; when Redis fails, the next
attempt waits out `BACKOFF_S` (one attempt per step, never redis-py's retries), and
when Redis answers with no policy at all (data loss, FLUSHALL) the last good values
stay in force. `stale` / `stale_reason` say so, for ``/readyz`` and the
``specops_serving_policy_stale`` gauge.

`RecordBuffer` queues finished requests' `DecodeRecord`s for the Redis publishers:
bounded (oldest dropped and counted past ``max_records``), flushed in order in batches of
one transaction each, and records that did not publish stay at the head of the queue for
the next flush.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
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
                pubsub = self.store.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.store.channel)
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
        r = self.store.redis
        keys = self.store.keys
        pipe = r.pipeline(transaction=True)
        pipe.get(keys["current"])
        pipe.get(keys["rollout"])
        pipe.get(keys["rollout_gen"])
        pipe.hgetall(keys["effective"])
        current, rollout_raw, gen, eff_raw = pipe.execute()
        stable = int(current) if current is not None else None
        rollout = RolloutState.from_json(rollout_raw, generation=int(gen or 0)) if rollout_raw is not None else None
        effective = {(k.decode() if isinstance(k, bytes) else str(k)): EffectiveSettings.from_json(v)
                     for k, v in eff_raw.items()}
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


FLUSH_BATCH = 64
"""Records per Redis transaction when a flush finds several queued. One transaction per record
(~40 commands each, encoded in Python) took 3.4% of a `specops serve` process's CPU samples at 16
streams (py-spy), on the policy thread beside the engine's: 2.5-2.7 ms of CPU per record against
0.09-0.14 ms in batches of 64 over three classes (the embedded Redis, 256 records)."""
RECORD_FLUSH_S = 1.0
"""The servers' shortest interval between record flushes (`RecordBuffer.min_interval_s`); their
policy thread polls every 0.2 s, which at ~10 finished requests a second left ~2 per flush. The
controller reads 10 s buckets every 2 s: a record a second late moves nothing it decides on."""


class RecordBuffer:
    """Bounded queue of (canary?, DecodeRecord) for the Redis publishers (see module docstring)."""

    def __init__(self, publisher: Any = None, canary_publisher: Any = None, *, max_records: int = 10_000,
                 clock: Callable[[], float] = time.monotonic, backoff_s: tuple[float, ...] = BACKOFF_S,
                 min_interval_s: float = 0.0) -> None:
        """``min_interval_s``: a flush sooner than this after the last one publishes nothing unless
        `FLUSH_BATCH` records wait (or ``force``), so that records go out several per transaction
        (the servers: `RECORD_FLUSH_S`)."""
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        self.min_interval_s = min_interval_s
        self._last_flush = float("-inf")
        self.publisher = publisher
        self.canary_publisher = canary_publisher
        self.max_records = max_records
        self.dropped = 0
        self.published = 0
        self.clock = clock
        self.backoff_s = tuple(backoff_s)
        self._failures = 0
        self._next_attempt = float("-inf")
        self._queue: deque[tuple[bool, Any, int]] = deque()  # (canary?, record, sequence number)
        self._seq = 0
        self._unsure: int | None = None  # sequence number of a record whose publish failed: applied or not?
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, record: Any, canary: bool = False) -> None:
        with self._lock:
            if len(self._queue) >= self.max_records:
                self._queue.popleft()
                self.dropped += 1
            self._seq += 1
            self._queue.append((canary, record, self._seq))

    def flush(self, force: bool = False) -> int:
        """Publish queued records oldest first until a publish fails; returns how many were published.

        Records go out in batches (`FLUSH_BATCH`, consecutive records for one publisher), one
        transaction each (`RedisPublisher.publish_many`). After a failure the next attempt waits
        out the backoff (unless ``force``).
        """
        done = 0
        now = self.clock()
        if not force and now < self._next_attempt:
            return 0
        if not force and now - self._last_flush < self.min_interval_s and len(self._queue) < FLUSH_BATCH:
            return 0
        self._last_flush = now
        with self._flush_lock:
            while True:
                with self._lock:
                    if not self._queue:
                        return done
                    canary = self._queue[0][0]
                    batch = []
                    for item in self._queue:
                        if item[0] != canary or len(batch) >= FLUSH_BATCH:
                            break
                        batch.append(item)
                publisher = self.canary_publisher if canary else self.publisher
                if publisher is not None:
                    try:
                        # a failed publish may have been applied (Redis died before replying): ask first,
                        # and drop what it carried instead of counting it twice
                        if self._unsure is not None and publisher.applied(self._unsure):
                            batch = [item for item in batch if item[2] <= self._unsure]
                        else:
                            publisher.publish_many([record for _, record, _ in batch], batch[-1][2])
                        self._unsure = None
                    except _FAILURES as exc:
                        self._unsure = batch[-1][2]
                        self._failures += 1
                        delay = self.backoff_s[min(self._failures, len(self.backoff_s)) - 1]
                        self._next_attempt = self.clock() + delay
                        log.warning("telemetry kept for later (%d queued, next try in %.2fs): %s",
                                    len(self._queue), delay, exc)
                        return done
                    self._failures = 0
                    self._next_attempt = float("-inf")
                with self._lock:
                    for _, record, _ in batch:  # those still queued (a full queue drops its oldest)
                        if self._queue and self._queue[0][1] is record:
                            self._queue.popleft()
                done += len(batch)
                self.published += len(batch)
