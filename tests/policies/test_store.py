"""PolicyStore against a real Redis: round trips, atomicity, fencing, notifications."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from specops.controller.leader import LeaderLease
from specops.policies import ConflictError, StaleEpochError, StateError, load_policy
from specops.policies.state import EffectiveSettings, RolloutState
from specops.policies.store import PolicyStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "policies" / "default.yaml"
SMALL = "version: s1\ndefault_class: a\nclasses:\n  - name: a\n  - name: b\n    method: medusa\n"


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def settings(name: str, gamma: int = 4, revision: int = 1, at: float = 0.0) -> EffectiveSettings:
    return EffectiveSettings(name, "draft", gamma, 3, 16, False, 0.05, revision, at)


def snapshot(r) -> dict:
    """Every key with its type and value, to prove that a rejected write changed nothing."""
    out = {}
    for key in sorted(r.keys("*")):
        kind = r.type(key).decode()
        if kind == "string":
            out[key] = r.get(key)
        elif kind == "hash":
            out[key] = r.hgetall(key)
        elif kind == "list":
            out[key] = r.lrange(key, 0, -1)
        elif kind == "stream":
            out[key] = [e[0] for e in r.xrange(key)]
    return out


def test_revision_round_trip_and_history(redis_client):
    clock = FakeClock()
    store = PolicyStore(redis_client, clock=clock)
    text = EXAMPLE.read_text()
    r1 = store.put_revision(load_policy(text), text)
    clock.t += 5
    r2 = store.put_revision(load_policy(SMALL), SMALL)
    assert (r1, r2) == (1, 2)
    got = store.get_revision(1)
    assert got.text == text and got.policy == load_policy(text) and got.created_at == 1000.0
    assert [h.revision for h in store.history()] == [1, 2]
    assert store.history()[1].created_at == 1005.0
    assert store.current_revision() is None and store.canary_revision() is None
    with pytest.raises(StateError, match="no policy revision 9"):
        store.get_revision(9)


def test_put_revision_rejects_mismatched_or_invalid_text(redis_client):
    store = PolicyStore(redis_client)
    with pytest.raises(ValueError, match="does not match"):
        store.put_revision(load_policy(SMALL), SMALL.replace("s1", "s2"))
    from specops.policies import PolicyError
    with pytest.raises(PolicyError):
        store.put_revision(load_policy(SMALL), "version: x\n")
    assert store.history() == [] and redis_client.keys("*") == []


def test_effective_merge_replace_and_publish(redis_client):
    store = PolicyStore(redis_client)
    pubsub = redis_client.pubsub()
    pubsub.subscribe(store.channel)
    assert pubsub.get_message(timeout=1.0)["type"] == "subscribe"
    store.set_effective({"a": settings("a"), "b": settings("b")}, epoch=None, reason="seed")
    store.set_effective({"a": settings("a", gamma=6)}, epoch=None, reason="adapt")
    eff = store.effective()
    assert eff["a"].gamma == 6 and eff["b"].gamma == 4
    store.set_effective({"c": settings("c")}, epoch=None, reason="new policy", replace=True)
    assert list(store.effective()) == ["c"]
    notes = [pubsub.get_message(timeout=1.0) for _ in range(3)]
    assert [n["type"] for n in notes] == ["message"] * 3
    assert b'"classes": ["c"]' in notes[2]["data"]
    pubsub.close()
    with pytest.raises(ValueError, match="filed under"):
        store.set_effective({"x": settings("a")}, epoch=None, reason="bad")
    audit = store.read_audit()
    assert [e["kind"] for e in audit] == ["effective.set"] * 3
    assert audit[1]["reason"] == "adapt" and audit[1]["settings"]["a"]["gamma"] == 6


def test_stale_epoch_is_rejected_and_changes_nothing(redis_client):
    store = PolicyStore(redis_client)
    old = LeaderLease(redis_client, store.lease_name, ttl_ms=50)
    assert old.try_acquire()
    store.set_effective({"a": settings("a")}, epoch=old.epoch, reason="leader 1")
    time.sleep(0.08)  # old's lease expires; a new leader takes over with a higher epoch
    new = LeaderLease(redis_client, store.lease_name, ttl_ms=5000)
    assert new.try_acquire() and new.epoch == old.epoch + 1
    before = snapshot(redis_client)
    for write in (
        lambda: store.set_effective({"a": settings("a", gamma=1)}, epoch=old.epoch, reason="stale"),
        lambda: store.set_rollout_state(RolloutState(1, None, 0, "progressing", 10), epoch=old.epoch),
        lambda: store.append_audit({"kind": "x"}, epoch=old.epoch),
        lambda: store.put_revision(load_policy(SMALL), SMALL, epoch=old.epoch),
        lambda: store.set_effective({"a": settings("a", gamma=1)}, epoch=new.epoch + 5, reason="future"),
    ):
        with pytest.raises(StaleEpochError) as info:
            write()
        assert info.value.current == new.epoch
    assert snapshot(redis_client) == before
    store.set_effective({"a": settings("a", gamma=7)}, epoch=new.epoch, reason="leader 2")
    assert store.effective()["a"].gamma == 7
    with pytest.raises(ValueError, match="non-negative int"):
        store.append_audit({"kind": "x"}, epoch=-1)


def test_rollout_state_round_trip_and_compare_and_set(redis_client):
    store = PolicyStore(redis_client)
    assert store.rollout_state() is None
    state = RolloutState(3, 2, 1, "progressing", 25, "step 1", [{"outcome": "successful"}], 10.0, 11.0)
    g1 = store.set_rollout_state(state, epoch=None)
    got = store.rollout_state()
    assert got.generation == g1 == 1
    assert (got.revision, got.stable_revision, got.step_index, got.phase, got.weight, got.analysis_runs) == \
        (3, 2, 1, "progressing", 25, [{"outcome": "successful"}])
    store.set_rollout_state(got, epoch=None, expect_generation=1)
    with pytest.raises(ConflictError):
        store.set_rollout_state(got, epoch=None, expect_generation=1)  # someone (we) wrote in between
    assert store.rollout_state().generation == 2
    with pytest.raises(ValueError, match="unknown rollout phase"):
        RolloutState(1, None, 0, "exploded", 0)


def test_commit_is_all_or_nothing(redis_client):
    store = PolicyStore(redis_client)
    rev = store.put_revision(load_policy(SMALL), SMALL)
    before = snapshot(redis_client)
    # current=99 does not exist: the effective settings and rollout state in the same commit must not land.
    with pytest.raises(StateError, match="no policy revision 99"):
        store.commit(epoch=None, actor="t", current=99, effective={"a": settings("a")},
                     rollout=RolloutState(rev, None, 0, "healthy", 100), audit=("x", {}))
    assert snapshot(redis_client) == before
    store.commit(epoch=None, actor="t", current=rev, effective={"a": settings("a")},
                 rollout=RolloutState(rev, None, 0, "healthy", 100), audit=("x", {}))
    assert store.current_revision() == rev and "a" in store.effective() and store.rollout_state().phase == "healthy"


def test_audit_stream_is_capped_and_ordered(redis_client):
    store = PolicyStore(redis_client, audit_maxlen=50)
    for i in range(400):
        store.append_audit({"kind": "tick", "i": i, "inputs": {"acceptance": 0.5}}, epoch=None)
    events = store.read_audit(count=1000)
    assert 50 <= len(events) < 400          # MAXLEN ~ trims approximately
    assert [e["i"] for e in events] == list(range(400 - len(events), 400))
    assert events[-1]["inputs"] == {"acceptance": 0.5} and events[-1]["actor"] == "controller"
