"""The rollout state machine on a real Redis: every transition and its guards."""

from __future__ import annotations

import collections

import pytest

from specops.policies import StateError, load_policy
from specops.policies import rollout as sm
from specops.policies.store import PolicyStore

V1 = """\
version: v1
default_class: a
classes:
  - name: a
    gamma: {initial: 4, min: 1, max: 8}
rollout:
  steps:
    - {weight: 10, pause_s: 60}
    - {weight: 50, pause_s: null}
"""
V2 = V1.replace("version: v1", "version: v2").replace("initial: 4, min: 1, max: 8", "initial: 3, min: 2, max: 5")
V3 = V1.replace("version: v1", "version: v3").replace("- name: a\n", "- name: a\n    method: ngram\n")


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def store(redis_client):
    return PolicyStore(redis_client, clock=Clock())


def start(store, text):
    return sm.start_rollout(store, load_policy(text), text)


def test_first_rollout_is_current_at_once(store):
    state = start(store, V1)
    assert (state.phase, state.weight, state.revision) == ("healthy", 100, 1)
    assert store.current_revision() == 1 and store.canary_revision() is None
    assert store.effective()["a"].gamma == 4 and store.effective()["a"].revision == 1


def test_canary_steps_then_promotion_completes(store):
    start(store, V1)
    state = start(store, V2)
    assert (state.phase, state.step_index, state.weight, state.stable_revision) == ("progressing", 0, 10, 1)
    assert store.canary_revision() == 2 and store.current_revision() == 1
    with pytest.raises(StateError, match="being rolled out"):
        start(store, V3)
    state = sm.promote(store)
    assert (state.step_index, state.weight) == (1, 50)
    state = sm.promote(store)
    assert (state.phase, state.weight) == ("healthy", 100)
    assert store.current_revision() == 2 and store.canary_revision() is None
    # the adapted gamma (4) is kept, clamped into the new bounds 2..5
    eff = store.effective()["a"]
    assert (eff.gamma, eff.revision) == (4, 2)
    with pytest.raises(StateError, match="no rollout in progress"):
        sm.promote(store)


def test_promote_full_and_method_change_resets_knobs(store):
    start(store, V1)
    start(store, V3)
    state = sm.promote(store, full=True)
    assert state.phase == "healthy" and store.current_revision() == 2
    eff = store.effective()["a"]
    assert (eff.method, eff.gamma) == ("ngram", 4)  # different method: initial value of the new policy


def test_abort_and_fail_return_traffic_to_stable(store):
    start(store, V1)
    start(store, V2)
    state = sm.abort(store, reason="operator said so")
    assert (state.phase, state.weight) == ("aborted", 0)
    assert store.current_revision() == 1 and store.canary_revision() is None
    with pytest.raises(StateError):
        sm.abort(store)
    start(store, V3)
    state = sm.fail(store, reason="acceptance collapsed", epoch=None)
    assert (state.phase, state.weight, store.current_revision()) == ("degraded", 0, 1)
    kinds = [e["kind"] for e in store.read_audit()]
    assert kinds.count("rollout.aborted") == 1 and kinds.count("rollout.degraded") == 1


def test_pause_then_promote_resumes_same_step(store):
    start(store, V1)
    start(store, V2)
    state = sm.pause(store, reason="inconclusive")
    assert state.phase == "paused" and state.weight == 10
    state = sm.promote(store)
    assert (state.phase, state.step_index, state.weight) == ("progressing", 0, 10)


def test_rollback_default_and_explicit(store):
    start(store, V1)
    start(store, V2)
    sm.promote(store, full=True)
    start(store, V3)  # canary in flight: rollback aborts it
    state = sm.rollback(store)
    assert (state.phase, state.revision) == ("healthy", 1)
    assert store.current_revision() == 1 and store.canary_revision() is None
    assert store.effective()["a"].revision == 1
    state = sm.rollback(store, to_revision=2)
    assert store.current_revision() == 2
    with pytest.raises(StateError, match="already current"):
        sm.rollback(store, to_revision=2)
    with pytest.raises(StateError, match="no policy revision 42"):
        sm.rollback(store, to_revision=42)


def test_rollback_without_history_is_an_error(store):
    with pytest.raises(StateError, match="no revision is current"):
        sm.rollback(store)
    start(store, V1)
    with pytest.raises(StateError, match="no earlier revision"):
        sm.rollback(store)


def test_advance_if_due_needs_elapsed_pause_and_a_successful_run(store):
    start(store, V1)
    start(store, V2)
    clock = store.clock
    assert sm.advance_if_due(store) is None               # pause not over
    clock.t += 61
    assert sm.advance_if_due(store) is None               # no successful analysis in this step
    sm.record_analysis(store, {"outcome": "inconclusive", "message": "no traffic"})
    assert sm.advance_if_due(store) is None
    sm.record_analysis(store, {"outcome": "successful", "message": "ok"})
    state = sm.advance_if_due(store)
    assert (state.step_index, state.weight) == (1, 50)
    clock.t += 10_000
    assert sm.advance_if_due(store) is None               # pause_s null: waits for promote
    assert [r["step_index"] for r in state.analysis_runs] == [0, 0]
    with pytest.raises(ValueError, match="outcome"):
        sm.record_analysis(store, {"outcome": "great"})


def test_pick_revision_splits_by_weight(store):
    start(store, V1)
    state = start(store, V2)  # 10% canary
    picks = collections.Counter(sm.pick_revision(state, 1, f"req-{i}") for i in range(4000))
    assert 0.07 < picks[2] / 4000 < 0.13
    assert sm.pick_revision(state, 1, "same") == sm.pick_revision(state, 1, "same")
    aborted = sm.abort(store)
    assert {sm.pick_revision(aborted, 1, f"r{i}") for i in range(200)} == {1}
