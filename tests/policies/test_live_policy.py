"""LivePolicy's refresh rules: a notified change applies on the next poll (before the reconcile
period), a change made without a notification applies at the next reconcile. (Redis down or
empty: `tests/serving/test_policy_runtime.py::test_live_policy_is_fail_static_with_backoff`.)"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from specops.policies import load_policy
from specops.policies import rollout as machine
from specops.policies.live import LivePolicy
from specops.policies.store import PolicyStore
from tests.serving.test_policy_runtime import POLICY



class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _poll_until(live: LivePolicy, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if live.poll():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def store(redis_client):
    store = PolicyStore(redis_client, namespace="live")
    machine.start_rollout(store, load_policy(POLICY), POLICY)
    return store


def test_a_notified_change_applies_on_the_next_poll(store):
    clock = Clock()
    live = LivePolicy(store, reconcile_s=60, clock=clock)
    try:
        assert live.settings_for("code").gamma == 3
        assert live.poll() is False  # nothing happened, reconcile not due
        eff = store.effective()["code"]
        store.set_effective({"code": replace(eff, gamma=7)}, epoch=None, reason="adapt")
        assert _poll_until(live)  # the clock never moved: the notification did it
        assert live.settings_for("code").gamma == 7
    finally:
        live.close()


def test_a_change_without_notification_applies_at_the_next_reconcile(store):
    clock = Clock()
    live = LivePolicy(store, reconcile_s=30, clock=clock, subscribe=False)
    try:
        eff = store.effective()["code"]
        store.redis.hset(store.keys["effective"], "code", replace(eff, gamma=2).to_json())  # no PUBLISH
        clock.t = 29.0
        assert live.poll() is False and live.settings_for("code").gamma == 3
        clock.t = 30.0
        assert live.poll() is True and live.settings_for("code").gamma == 2
    finally:
        live.close()
    with pytest.raises(ValueError, match="reconcile_s"):
        LivePolicy(store, reconcile_s=0)
