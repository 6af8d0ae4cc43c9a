"""SettingsWatcher: notified changes apply on the next poll; missed ones on reconcile; Redis down keeps last."""

from __future__ import annotations

import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specops.policies.state import EffectiveSettings
from specops.policies.store import PolicyStore
from specops.policies.watcher import SettingsWatcher
from tests.services import start_redis


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def eff(name: str, gamma: int) -> EffectiveSettings:
    return EffectiveSettings(name, "draft", gamma, 3, 16, False, 0.05, 1, 0.0)


def _poll_until(watcher: SettingsWatcher, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if watcher.poll():
            return True
        time.sleep(0.01)
    return False


def test_notification_applies_on_next_poll(redis_client):
    store = PolicyStore(redis_client)
    store.set_effective({"a": eff("a", 4)}, epoch=None, reason="seed")
    clock = Clock()
    watcher = SettingsWatcher(store, reconcile_s=60, clock=clock)
    try:
        assert watcher.settings_for("a").gamma == 4
        assert watcher.poll() is False                   # nothing happened, not due
        store.set_effective({"a": eff("a", 7)}, epoch=None, reason="adapt")
        assert _poll_until(watcher)                       # the clock never moved: this is the notification
        assert watcher.settings_for("a").gamma == 7
    finally:
        watcher.close()


def test_missed_notification_is_reconciled(redis_client):
    store = PolicyStore(redis_client)
    store.set_effective({"a": eff("a", 4)}, epoch=None, reason="seed")
    clock = Clock()
    watcher = SettingsWatcher(store, reconcile_s=30, clock=clock)
    try:
        redis_client.hset(store.keys["effective"], "a", eff("a", 2).to_json())   # changed without PUBLISH
        clock.t = 29.0
        assert watcher.poll() is False and watcher.settings_for("a").gamma == 4
        clock.t = 30.0
        assert watcher.poll() is True and watcher.settings_for("a").gamma == 2
    finally:
        watcher.close()


@pytest.mark.services
def test_redis_down_keeps_last_known_settings(tmp_path):
    svc = start_redis(tmp_path)
    client = redis.Redis(port=svc.port, socket_timeout=1, socket_connect_timeout=1,
                         retry=Retry(NoBackoff(), 0))   # fail at once instead of backing off
    store = PolicyStore(client)
    store.set_effective({"a": eff("a", 5)}, epoch=None, reason="seed")
    clock = Clock()
    watcher = SettingsWatcher(store, reconcile_s=1, clock=clock)
    svc.stop()
    clock.t = 5.0
    assert watcher.poll() is False
    assert watcher.settings_for("a").gamma == 5
    watcher.close()
    client.close()
    with pytest.raises(ValueError, match="reconcile_s"):
        SettingsWatcher(store, reconcile_s=0)
