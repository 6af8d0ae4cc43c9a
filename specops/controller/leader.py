"""Leader election for controllers: a Redis lease with a fencing epoch.

Several controllers may run at once (one per sidecar, or a standby); exactly one
acts. The lease is one Redis key holding the leader's random token, written with
``SET NX PX`` so it expires ``ttl_ms`` after the last renewal. Renewal and release
compare the token in a Lua script, so a controller never extends or deletes a
lease it no longer owns.

Each acquisition increments ``<name>:epoch`` in the same script. The leader passes
that epoch with every store write (``specops.policies.store``), and the store
rejects a write whose epoch is not the current one: a paused leader that wakes up
after its lease expired cannot overwrite its successor's decisions.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)

# KEYS: lease, epoch   ARGV: token, ttl_ms   -> {held (0/1), epoch}
_ACQUIRE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('GET', KEYS[2]) or '0')}
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {1, redis.call('INCR', KEYS[2])}
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

    def __init__(self, redis_client: redis.Redis, name: str = "specops:leader", ttl_ms: int = 10_000,
                 clock: Callable[[], float] = time.monotonic, *, safety_ms: int | None = None,
                 holder: str | None = None):
        if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms < 10:
            raise ValueError(f"ttl_ms must be an int >= 10, got {ttl_ms!r}")
        self.redis = redis_client
        self.name = name
        self.epoch_key = f"{name}:epoch"
        self.ttl_ms = ttl_ms
        self.safety_ms = ttl_ms // 10 if safety_ms is None else safety_ms
        if not 0 <= self.safety_ms < ttl_ms:
            raise ValueError(f"safety_ms must lie in [0, ttl_ms), got {self.safety_ms}")
        self.clock = clock
        self.token = f"{holder or 'controller'}:{uuid.uuid4().hex}"
        self.epoch = 0
        self._valid_until: float | None = None
        self._acquire = redis_client.register_script(_ACQUIRE)
        self._renew = redis_client.register_script(_RENEW)
        self._release = redis_client.register_script(_RELEASE)

    @property
    def is_leader(self) -> bool:
        return self._valid_until is not None and self.clock() < self._valid_until

    def try_acquire(self) -> bool:
        """Take the lease if it is free (or renew it if already ours); True when we lead."""
        started = self.clock()
        held, epoch = self._acquire(keys=[self.name, self.epoch_key], args=[self.token, self.ttl_ms])
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
