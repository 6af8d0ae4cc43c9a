"""Leader election for controllers: a Redis lease with a fencing epoch.

Several controllers may run at once (one per sidecar, or a standby); exactly one
acts. The lease is one Redis key holding the leader's random token, written with
``SET NX PX`` so it expires ``ttl_ms`` after the last renewal. Renewal and release
compare the token in a Lua script, so a controller never extends or deletes a
lease it no longer owns.

Each acquisition increments ``<name>:epoch`` in the same script. The leader passes
its :class:`~specops.policies.store.Fence` (that epoch and its token) with every
store write (``specops.policies.store``), and the store rejects a write whose epoch
is not the current one or whose token does not hold the lease: a paused leader
that wakes up after its lease expired cannot overwrite its successor's decisions —
even when Redis lost its data meanwhile and the successor got the same epoch. To
keep epochs monotonic across such a loss as far as one process can tell, a lease
never takes an epoch lower than one it has seen (``floor`` in the acquire script).

The lease is kept by :class:`LeaseKeeper`, a thread that renews (or acquires) it
every ``renew_every_s`` independently of the control loop's ticks, so a slow tick
(a slow Prometheus query) does not cost the leadership.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import redis

from specops.policies.errors import StoreUnavailableError
from specops.policies.keys import lease_epoch_key
from specops.policies.store import Fence

log = logging.getLogger(__name__)

# KEYS: lease, epoch   ARGV: token, ttl_ms, floor (highest epoch the caller has seen)   -> {held (0/1), epoch}
_ACQUIRE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('GET', KEYS[2]) or '0')}
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local epoch = redis.call('INCR', KEYS[2])
  if epoch <= tonumber(ARGV[3]) then
    epoch = tonumber(ARGV[3]) + 1
    redis.call('SET', KEYS[2], epoch)
  end
  return {1, epoch}
end
return {0, tonumber(redis.call('GET', KEYS[2]) or '0')}
"""

# KEYS: lease   ARGV: token, ttl_ms   -> 1 renewed, 0 not ours
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS: lease   ARGV: token   -> 1 released, 0 not ours
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaderLease:
    """A lease named ``name`` in Redis; ``epoch`` is the fencing token of the current tenure.

    ``is_leader`` is the holder's own conservative view: true only while the last
    successful acquire/renew is younger than ``ttl_ms`` minus ``safety_ms`` by
    ``clock`` (monotonic seconds), so a leader stops acting before Redis lets the
    lease go to another controller.
    """

    def __init__(self, redis_client: redis.Redis, name: str = "{specops}:leader", ttl_ms: int = 10_000,
                 clock: Callable[[], float] = time.monotonic, *, safety_ms: int | None = None,
                 holder: str | None = None):
        if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms < 10:
            raise ValueError(f"ttl_ms must be an int >= 10, got {ttl_ms!r}")
        self.redis = redis_client
        self.name = name
        self.epoch_key = lease_epoch_key(name)
        self.ttl_ms = ttl_ms
        self.safety_ms = ttl_ms // 10 if safety_ms is None else safety_ms
        if not 0 <= self.safety_ms < ttl_ms:
            raise ValueError(f"safety_ms must lie in [0, ttl_ms), got {self.safety_ms}")
        self.clock = clock
        self.token = f"{holder or 'controller'}:{uuid.uuid4().hex}"
        self.epoch = 0
        self.highest_seen_epoch = 0
        self._valid_until: float | None = None
        self._acquire = redis_client.register_script(_ACQUIRE)
        self._renew = redis_client.register_script(_RENEW)
        self._release = redis_client.register_script(_RELEASE)

    @property
    def is_leader(self) -> bool:
        return self._valid_until is not None and self.clock() < self._valid_until

    @property
    def fence(self) -> Fence:
        """What this holder's writes carry (epoch and token)."""
        return Fence(self.epoch, self.token)

    def try_acquire(self) -> bool:
        """Take the lease if it is free (or renew it if already ours); True when we lead."""
        started = self.clock()
        held, epoch = self._acquire(keys=[self.name, self.epoch_key],
                                    args=[self.token, self.ttl_ms, self.highest_seen_epoch])
        self.highest_seen_epoch = max(self.highest_seen_epoch, int(epoch))
        if int(held):
            if int(epoch) != self.epoch:
                log.info("lease %s acquired by %s (epoch %s)", self.name, self.token, epoch)
            self.epoch = int(epoch)
            self._valid_until = started + (self.ttl_ms - self.safety_ms) / 1000.0
            return True
        self._lose("held by another controller")
        return False

    def renew(self) -> bool:
        """Extend our lease by ``ttl_ms``; False (and no longer leader) if it is not ours any more."""
        if self._valid_until is None:
            return False
        started = self.clock()
        if int(self._renew(keys=[self.name], args=[self.token, self.ttl_ms])):
            self._valid_until = started + (self.ttl_ms - self.safety_ms) / 1000.0
            return True
        self._lose("lease expired or taken over")
        return False

    def release(self) -> bool:
        """Give the lease up now (on clean shutdown), so a standby takes over at once."""
        self._valid_until = None
        return bool(int(self._release(keys=[self.name], args=[self.token])))

    def holder(self) -> str | None:
        """Token of whoever holds the lease now (None when free)."""
        raw = self.redis.get(self.name)
        return raw.decode() if isinstance(raw, bytes) else raw

    def _lose(self, why: str) -> None:
        if self._valid_until is not None:
            log.warning("lease %s lost by %s: %s", self.name, self.token, why)
        self._valid_until = None


class LeaseKeeper:
    """Renews (or acquires) ``lease`` every ``renew_every_s`` on its own thread, apart from ticks.

    ``renew_every_s`` must leave room for at least two renewals within the lease's
    validity (``ttl_ms - safety_ms``): one lost renewal (a Redis blip) must not cost
    the lease. A Redis error is logged and retried at the next period; the lease's
    own validity window makes it stop leading in time.

    A standby tries to acquire more often than the leader renews (``standby_every_s``,
    a tenth of the validity, at least 50 ms): a killed leader's lease expires at most
    ``ttl_ms`` after its last renewal, and the standby then takes over within that
    tenth instead of within a whole renewal period (one ``SET NX`` per attempt).
    """

    def __init__(self, lease: LeaderLease, renew_every_s: float | None = None,
                 on_change: Callable[[bool], None] | None = None) -> None:
        valid_s = (lease.ttl_ms - lease.safety_ms) / 1000.0
        period = valid_s / 3.0 if renew_every_s is None else float(renew_every_s)
        if not 0 < period <= valid_s / 2.0:
            raise ValueError(f"renew_every_s must lie in (0, {valid_s / 2.0:g}] for a lease valid {valid_s:g}s "
                             f"(ttl {lease.ttl_ms} ms minus safety {lease.safety_ms} ms), got {renew_every_s!r}")
        self.lease = lease
        self.renew_every_s = period
        self.standby_every_s = min(period, max(valid_s / 10.0, 0.05))
        self.on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def keep(self) -> bool:
        """One renewal (or acquisition attempt); True while we lead."""
        with self._lock:
            before = self.lease.is_leader
            try:
                ok = self.lease.renew() if before else self.lease.try_acquire()
            except (redis.RedisError, StoreUnavailableError, OSError) as exc:
                log.warning("lease %s: renewal failed (%s); retrying in %.1fs", self.lease.name, exc,
                            self.renew_every_s)
                ok = self.lease.is_leader
            if self.on_change is not None and ok != before:
                self.on_change(ok)
            return ok

    def _run(self) -> None:
        while not self._stop.is_set():
            leading = self.keep()
            self._stop.wait(self.renew_every_s if leading else self.standby_every_s)

    def start(self) -> LeaseKeeper:
        if self._thread is not None:
            raise RuntimeError("lease keeper already started")
        self._thread = threading.Thread(target=self._run, name="specops-lease", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, release: bool = True, timeout_s: float = 5.0) -> None:
        """Stop renewing; with ``release``, give the lease up so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if release and self.lease.is_leader:
            try:
                self.lease.release()
            except (redis.RedisError, OSError) as exc:
                log.warning("lease %s: release failed (%s); it expires by itself", self.lease.name, exc)
