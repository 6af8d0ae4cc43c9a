"""The runtime side of the effective settings: notifications plus periodic reconciliation.

An inference pod (or its sidecar) keeps a :class:`SettingsWatcher` and calls
:meth:`SettingsWatcher.poll` between requests. A PUBLISH on the store's channel
makes the next poll reload the settings at once; independently, the settings are
re-read every ``reconcile_s`` seconds, so a missed notification (a reconnect, a
dropped connection) only delays a change, never loses it. While Redis is down the
last known settings stay in force.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from specops.policies.errors import StoreUnavailableError
from specops.policies.state import EffectiveSettings
from specops.policies.store import PolicyStore

log = logging.getLogger(__name__)


class SettingsWatcher:
    """Last known per-class :class:`EffectiveSettings`, kept fresh by notification and polling."""

    def __init__(self, store: PolicyStore, *, reconcile_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        if not reconcile_s > 0:
            raise ValueError(f"reconcile_s must be > 0, got {reconcile_s!r}")
        self.store = store
        self.reconcile_s = reconcile_s
        self.clock = clock
        self.reloads = 0
        self._settings: dict[str, EffectiveSettings] = {}
        self._loaded_at: float | None = None
        self._pubsub: redis.client.PubSub | None = None
        self._subscribe()
        self._reload()

    @property
    def settings(self) -> dict[str, EffectiveSettings]:
        return dict(self._settings)

    def settings_for(self, request_class: str) -> EffectiveSettings | None:
        return self._settings.get(request_class)

    def poll(self) -> bool:
        """Reload if notified or if the reconcile period passed; True when the settings were re-read."""
        notified = self._drain()
        due = self._loaded_at is None or self.clock() - self._loaded_at >= self.reconcile_s
        if notified or due:
            return self._reload()
        return False

    def close(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except redis.RedisError:
                pass
            self._pubsub = None

    def _subscribe(self) -> None:
        try:
            pubsub = self.store.redis.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(self.store.channel)
            self._pubsub = pubsub
        except (redis.RedisError, OSError) as exc:
            log.warning("cannot subscribe to %s (will reconcile by polling): %s", self.store.channel, exc)
            self._pubsub = None

    def _drain(self) -> bool:
        """Consume pending notifications without blocking; True if any arrived."""
        if self._pubsub is None:
            self._subscribe()
            return self._pubsub is not None  # (re)subscribed: we may have missed changes meanwhile
        notified = False
        try:
            while True:
                message = self._pubsub.get_message(timeout=0)
                if message is None:
                    break
                notified = notified or message.get("type") == "message"
        except (redis.RedisError, OSError) as exc:
            log.warning("lost the settings channel: %s", exc)
            self.close()
        return notified

    def _reload(self) -> bool:
        try:
            fresh = self.store.effective()
        except (StoreUnavailableError, redis.RedisError) as exc:
            log.warning("keeping the last known settings; Redis unavailable: %s", exc)
            return False
        self._settings = fresh
        self._loaded_at = self.clock()
        self.reloads += 1
        return True
