"""The controller under failure: each scenario against a real Redis.

A Redis that loses its data, a rollback requested twice, a write that does not
land, a webhook that reaches the standby, a paused rollout that is resumed.
"""

from __future__ import annotations

import email.message
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import redis
from prometheus_client import CollectorRegistry

from specops.alerts.server import ControlServer
from specops.alerts.webhook import AlertAction, WebhookReceiver
from specops.controller.controller import Controller
from specops.controller.leader import LeaderLease, LeaseKeeper
from specops.controller.sources import Reading
from specops.policies import parse_policy
from specops.policies import rollout as machine
from specops.policies.errors import CurrentChangedError, LeaseLostError, StaleEpochError, StateError
from specops.policies.store import PolicyStore
from tests.alerts.payloads import alert, alertmanager
from tests.controller.test_controller import POLICY, Rig

ROLLBACK_POLICY = """
version: r1
default_class: code
classes:
  - name: code
    gamma: {initial: 2, min: 1, max: 8}
    adaptation: {mode: fixed}
alerts:
  - {name: awful, metric: speedup, op: "<", threshold: 1.0, for_s: 0, min_samples: 100, action: rollback}
rollout:
  steps: [{weight: 20, pause_s: 30}, {weight: 100}]
"""

CANARY_POLICY = """
version: c1
default_class: code
classes:
  - name: code
    gamma: {initial: 2, min: 1, max: 8}
    adaptation: {mode: fixed}
alerts:
  - {name: slower, metric: speedup, op: "<", threshold: 1.0, for_s: 0, min_samples: 100, action: notify}
rollout:
  steps: [{weight: 20, pause_s: 30, analysis: true}, {weight: 100}]
  analysis: {interval_s: 10, window_s: 10, failure_limit: 0, inconclusive_limit: 0, rules: [slower]}
"""

GOOD, SLOW = (0.9, 1.0), (0.9, 12.0)  # (acceptance, draft cost factor): speed-up > 1 and < 1


class WritesRefused:
    """Make the real Redis refuse every write (as a primary without its replicas does) while active."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def __enter__(self) -> WritesRefused:
        self.client.config_set("min-replicas-to-write", 1)
        return self

    def __exit__(self, *exc) -> None:
        self.client.config_set("min-replicas-to-write", 0)


def step_with_writes_refused(rig: Rig, per_class: dict) -> None:
    """Publish a bucket of traffic as ``rig.step`` does, then tick while Redis refuses writes."""
    tick = rig.ctl.tick

    def refused_tick():
        with WritesRefused(rig.redis):
            return tick()

    rig.ctl.tick = refused_tick
    try:
        with pytest.raises(redis.ResponseError, match="NOREPLICAS"):
            rig.step(per_class)
    finally:
        rig.ctl.tick = tick


# ----------------------------------------------------------------------------- bug 1
def test_stale_leader_cannot_write_after_redis_lost_its_data(redis_client):
    store = PolicyStore(redis_client)
    machine.start_rollout(store, parse_policy(POLICY), POLICY)
    a = LeaderLease(redis_client, store.lease_name, ttl_ms=60_000)
    assert a.try_acquire() and a.epoch == 1
    eff = store.effective()["code"]
    redis_client.flushall()  # Redis restarted without persistence: lease, epoch and policy gone
    machine.start_rollout(store, parse_policy(POLICY), POLICY)  # re-seeded
    b = LeaderLease(redis_client, store.lease_name, ttl_ms=60_000)
    assert b.try_acquire() and b.epoch == 1  # the same epoch as the paused A
    with pytest.raises(LeaseLostError):
        store.set_effective({"code": eff}, epoch=a.fence, reason="stale A wakes up")
    assert store.effective()["code"].gamma == 2
    store.set_effective({"code": eff}, epoch=b.fence, reason="B leads")  # the real leader writes
    # and the stale controller's whole tick writes nothing: A still believes it leads (its keeper was paused)
    ctl = Controller(store, _EmptySource(), lease=a, keeper=LeaseKeeper(a), registry=CollectorRegistry())
    redis_client.delete(store.keys["effective"])  # so that A's tick has something to write (the seed)
    assert a.is_leader and ctl.tick() == [] and store.effective() == {}


def test_epochs_stay_monotonic_for_a_lease_that_saw_a_higher_one(redis_client):
    lease = LeaderLease(redis_client, "x:leader", ttl_ms=60_000)
    for _ in range(3):
        assert lease.try_acquire()
        lease.release()
    assert lease.epoch == 3
    redis_client.flushall()
    assert lease.try_acquire() and lease.epoch == 4  # not 1 again
    with pytest.raises(StaleEpochError):
        PolicyStore(redis_client, lease_name="x:leader").append_audit({"kind": "x"}, epoch=3)


class _EmptySource:
    def read(self, request_class, window_s):
        return Reading(None)


# ----------------------------------------------------------------------------- bug 2
def _promote_second_revision(rig: Rig) -> None:
    second = ROLLBACK_POLICY.replace("version: r1", "version: r2-bad")
    machine.start_rollout(rig.store, parse_policy(second), second)
    machine.promote(rig.store, full=True)
    assert rig.store.current_revision() == 2
    rig.clock.advance(30)  # the window now measures revision 2 only


def test_rollback_twice_never_restores_the_bad_revision(redis_client):
    rig = Rig(redis_client, ROLLBACK_POLICY)
    rig.step({"code": GOOD})
    _promote_second_revision(rig)
    rig.step({"code": GOOD})  # seeds revision 2's settings
    rolled_back_at = rig.clock.now
    decisions = rig.step({"code": SLOW})
    assert [d.kind for d in decisions if d.kind.startswith("rollout.")] == ["rollout.rollback"]
    assert rig.store.current_revision() == 1
    # the same rule via Alertmanager (it started firing before the rollback)
    hook = rig.ctl.apply_alert(AlertAction("rollback", None, "awful", "fp", starts_at=rolled_back_at - 5))
    assert [d.kind for d in hook] == ["rollout.rollback_skipped"] and rig.store.current_revision() == 1
    # ... without a start time, and from a restarted controller that still sees the old window
    rig.ctl.apply_alert(AlertAction("rollback", None, "awful", "fp2"))
    assert rig.store.current_revision() == 1
    restarted = Controller(rig.store, rig.ctl.source, clock=rig.clock, registry=CollectorRegistry(), window_s=10)
    for _ in range(3):
        rig.ctl = restarted
        rig.step({"code": SLOW})
        assert rig.store.current_revision() == 1
    # the store-level guard: a rollback decided against revision 2 happens once
    with pytest.raises(CurrentChangedError):
        machine.rollback(rig.store, expect_current=2, reason="late duplicate")
    with pytest.raises(StateError, match="not rolled back from"):
        machine.rollback(rig.store, reason="operator, default target")  # never back to 2
    assert rig.store.current_revision() == 1 and rig.store.rolled_back_revisions() == {2}


# ----------------------------------------------------------------------------- bug 3
def test_canary_with_a_failed_run_is_never_promoted(redis_client):
    rig = Rig(redis_client, CANARY_POLICY)
    rig.step({"code": GOOD})
    canary = CANARY_POLICY.replace("version: c1", "version: c2")
    machine.start_rollout(rig.store, parse_policy(canary), canary)
    rig.step({"code": GOOD}, canary={"code": (0.9, 1.0, 2)})
    assert [r["outcome"] for r in rig.store.rollout_state().analysis_runs] == ["successful"]
    # a failed run lands but the write of its consequence does not (an older controller wrote them apart)
    machine.record_analysis(rig.store, {"outcome": "failed", "message": "speed-up 0.4"})
    state = rig.store.rollout_state()
    assert state.phase == "progressing"
    rig.clock.now = state.step_started_at + 31  # pause elapsed, next analysis not yet due
    decisions = rig.ctl.tick()
    state = rig.store.rollout_state()
    assert state.phase == "degraded" and rig.store.current_revision() == 1, [d.kind for d in decisions]
    assert "rollout.rollback" in [d.kind for d in decisions]


def test_failed_run_and_its_rollback_are_one_write(redis_client):
    rig = Rig(redis_client, CANARY_POLICY)
    rig.step({"code": GOOD})
    canary = CANARY_POLICY.replace("version: c1", "version: c2")
    machine.start_rollout(rig.store, parse_policy(canary), canary)
    gen = rig.store.rollout_state().generation
    rig.step({"code": GOOD}, canary={"code": (0.9, 12.0, 2)})
    state = rig.store.rollout_state()
    assert state.phase == "degraded" and state.generation == gen + 1  # one write: run + verdict
    kinds = [e["kind"] for e in rig.store.read_audit(5)]
    assert kinds[-2:] == ["rollout.analysis", "rollout.degraded"]


# ----------------------------------------------------------------------------- bug 4
def test_fallback_whose_write_failed_is_written_by_the_next_tick(redis_client):
    rig = Rig(redis_client)
    rig.step({"code": GOOD, "chat": GOOD})
    rig.step({"code": SLOW, "chat": GOOD})
    rig.step({"code": SLOW, "chat": GOOD})
    step_with_writes_refused(rig, {"code": SLOW, "chat": GOOD})  # for_s reached: fallback decided, write refused
    assert not rig.store.effective()["code"].fallback_active
    decisions = rig.step({"code": SLOW, "chat": GOOD})
    assert "fallback_on" in [d.kind for d in decisions if d.request_class == "code"]
    assert rig.store.effective()["code"].fallback_active


def test_rollback_whose_write_failed_is_retried(redis_client):
    rig = Rig(redis_client, ROLLBACK_POLICY)
    rig.step({"code": GOOD})
    _promote_second_revision(rig)
    rig.step({"code": GOOD})
    step_with_writes_refused(rig, {"code": SLOW})
    assert rig.store.current_revision() == 2
    decisions = rig.step({"code": SLOW})
    assert "rollout.rollback" in [d.kind for d in decisions] and rig.store.current_revision() == 1


def test_fallback_cleared_in_the_store_is_not_kept_in_memory(redis_client):
    rig = Rig(redis_client)
    rig.step({"code": GOOD, "chat": GOOD})
    rig.ctl.apply_alert(AlertAction("fallback", "code", "slower", "fp"))
    assert rig.ctl.fallback.is_active("code")
    eff = rig.store.effective()["code"]
    from dataclasses import replace

    rig.store.set_effective({"code": replace(eff, fallback_active=False)}, epoch=None, reason="operator clears")
    rig.step({"code": GOOD, "chat": GOOD})
    assert not rig.ctl.fallback.is_active("code")


# ----------------------------------------------------------------------------- bug 5
def _post(url: str, body: bytes, token: str = "tok") -> tuple[int, dict, "email.message.Message"]:
    req = urllib.request.Request(url + "/webhook/alertmanager", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}"), err.headers


def test_webhook_on_the_standby_is_retried_until_the_leader_acts(redis_client):
    rig = Rig(redis_client)
    rig.step({"code": GOOD, "chat": GOOD})
    leader = LeaderLease(redis_client, rig.store.lease_name, ttl_ms=60_000)
    assert leader.try_acquire()
    standby = Controller(rig.store, rig.ctl.source, clock=rig.clock, registry=CollectorRegistry(), window_s=10,
                         lease=LeaderLease(redis_client, rig.store.lease_name, ttl_ms=60_000))
    server = ControlServer(WebhookReceiver("tok", standby.apply_alert)).start()
    try:
        body = alertmanager(alert(cls="code", rule="slower", action="fallback", fingerprint="fp-code"))
        status, answer, headers = _post(server.url, body)
        assert status == 503 and "not the leader" in answer["error"] and int(headers["Retry-After"]) >= 1
        assert not rig.store.effective()["code"].fallback_active
        leader.release()  # failover: the standby takes over; Alertmanager's retry reaches it
        status, answer, _ = _post(server.url, body)
        assert status == 200 and answer["actions"] == 1 and rig.store.effective()["code"].fallback_active
        # an unknown class is the sender's mistake: 4xx with the message, never 5xx
        status, answer, _ = _post(server.url, alertmanager(alert(cls="nope", fingerprint="fp-nope")))
        assert status == 422 and "'nope'" in answer["error"]
        # a rule label without an action label: the policy's rule says "fallback"
        status, answer, _ = _post(server.url, alertmanager(alert(cls="chat", rule="slower", action=None,
                                                                 fingerprint="fp-chat")))
        assert status == 200 and rig.store.effective()["chat"].fallback_active
        status, answer, _ = _post(server.url, alertmanager(alert(cls="chat", rule="no-such-rule", action=None,
                                                                 fingerprint="fp-x")))
        assert status == 422 and "no-such-rule" in answer["error"]
    finally:
        server.stop()


# ----------------------------------------------------------------------------- bug 7
def test_paused_rollout_resumes_with_a_fresh_analysis(redis_client):
    rig = Rig(redis_client, CANARY_POLICY)
    rig.step({"code": GOOD})
    canary = CANARY_POLICY.replace("version: c1", "version: c2")
    machine.start_rollout(rig.store, parse_policy(canary), canary)
    rig.step({"code": GOOD})  # no canary traffic: inconclusive > limit 0 -> paused
    assert rig.store.rollout_state().phase == "paused"
    machine.promote(rig.store)  # the operator resumes
    for _ in range(5):
        rig.step({"code": GOOD}, canary={"code": (0.9, 1.0, 2)})
    state = rig.store.rollout_state()
    outcomes = [r["outcome"] for r in state.analysis_runs]
    assert outcomes[0] == "inconclusive" and "successful" in outcomes
    assert state.phase == "healthy" and rig.store.current_revision() == state.revision


class SwitchableSource:
    """The canary source, or — while ``down`` — a metric backend that cannot be reached."""

    def __init__(self, real) -> None:
        self.real, self.down, self.name = real, False, "switchable"

    def read(self, request_class, window_s):
        if self.down:
            return Reading(None, "prometheus query failed: connection refused")
        return self.real.read(request_class, window_s)


def outage_rig(redis_client, limit: int) -> tuple[Rig, SwitchableSource]:
    lenient = CANARY_POLICY.replace("failure_limit: 0", f"failure_limit: 5, consecutive_error_limit: {limit}")
    rig = Rig(redis_client, lenient)
    rig.step({"code": GOOD})
    canary = lenient.replace("version: c1", "version: c2")
    machine.start_rollout(rig.store, parse_policy(canary), canary)
    source = SwitchableSource(rig.ctl.rollout.canary_source)
    rig.ctl.rollout.canary_source = source
    return rig, source


def test_metric_source_down_holds_the_step_then_pauses_never_rolls_back(redis_client):
    rig, source = outage_rig(redis_client, limit=2)
    rig.step({"code": GOOD}, canary={"code": (0.9, 1.0, 2)})  # one successful run at step 0
    source.down = True
    seen = []
    for _ in range(5):  # 50 s: well past the step's 30 s pause
        kinds = [d.kind for d in rig.step({"code": GOOD}, canary={"code": (0.9, 1.0, 2)})]
        state = rig.store.rollout_state()
        seen.append((state.phase, state.step_index))
        assert "rollout.rollback" not in kinds and "rollout.step" not in kinds
    # two unreachable runs hold at step 0 (not promoted although the pause is over), the third pauses
    assert seen == [("progressing", 0), ("progressing", 0), ("paused", 0), ("paused", 0), ("paused", 0)]
    state = rig.store.rollout_state()
    assert "unreachable for 3 consecutive runs" in state.message and rig.store.current_revision() == 1
    runs = [r for r in state.analysis_runs if r.get("unreachable")]
    assert len(runs) == 3 and {r["outcome"] for r in runs} == {"inconclusive"}
    audit = rig.store.read_audit(200)
    assert not [e for e in audit if e["kind"] in ("rollout.degraded", "rollout.rollback")]
    # the source is back and the operator resumes: a fresh attempt is analysed and completes
    source.down = False
    machine.promote(rig.store)
    for _ in range(5):
        rig.step({"code": GOOD}, canary={"code": (0.9, 1.0, 2)})
    state = rig.store.rollout_state()
    assert state.phase == "healthy" and rig.store.current_revision() == state.revision == 2


def test_short_metric_outage_holds_then_the_rollout_carries_on_by_itself(redis_client):
    rig, source = outage_rig(redis_client, limit=4)
    rig.step({"code": GOOD}, canary={"code": (0.9, 1.0, 2)})
    source.down = True
    for _ in range(3):  # past the 30 s pause, but every run since the success is unreachable
        rig.step({"code": GOOD}, canary={"code": (0.9, 1.0, 2)})
        assert (rig.store.rollout_state().phase, rig.store.rollout_state().step_index) == ("progressing", 0)
    source.down = False
    for _ in range(2):
        rig.step({"code": GOOD}, canary={"code": (0.9, 1.0, 2)})
    state = rig.store.rollout_state()
    assert state.phase == "healthy" and rig.store.current_revision() == 2


# ----------------------------------------------------------------------------- smaller ones
def test_operator_rollback_between_read_and_write_is_not_overwritten(redis_client):
    rig = Rig(redis_client)
    rig.step({"code": GOOD, "chat": GOOD})
    second = POLICY.replace("version: t1", "version: t2").replace("initial: 2", "initial: 3")
    machine.start_rollout(rig.store, parse_policy(second), second)
    machine.promote(rig.store, full=True)
    rig.step({"code": GOOD, "chat": GOOD})
    assert rig.store.effective()["code"].revision == 2
    source = rig.ctl.source
    after_rollback = {}

    class RollbackDuringRead:
        def read(self, request_class, window_s):
            if request_class == "code":  # the operator's rollback lands between the tick's read and its write
                machine.rollback(rig.store, reason="operator")
                after_rollback.update(rig.store.effective())
            return source.read(request_class, window_s)

    rig.ctl.source = RollbackDuringRead()
    rig.clock.advance(100)
    # acceptance dropped: the tick would shorten code's γ; the rollback makes it conflict instead
    assert rig.step({"code": (0.4, 1.0), "chat": GOOD}) == []
    assert rig.store.current_revision() == 1 and rig.store.effective() == after_rollback
    assert {e.revision for e in after_rollback.values()} == {1}
    rig.ctl.source = source
    decisions = rig.step({"code": (0.4, 1.0), "chat": GOOD})  # the next tick works on the rolled-back state
    assert "adapt" in [d.kind for d in decisions if d.request_class == "code"]
    assert rig.store.effective()["code"].revision == 1


def test_retried_scripts_apply_once(redis_client):
    store = PolicyStore(redis_client)
    policy = parse_policy(POLICY)
    first = store.put_revision(policy, POLICY, request_id="req-1")
    again = store.put_revision(policy, POLICY, request_id="req-1")  # what redis-py's retry re-sends
    assert first == again == 1 and [r.revision for r in store.history()] == [1]
    machine.start_rollout(store, policy, POLICY)
    state = store.rollout_state()
    from dataclasses import replace

    gen = store.commit(epoch=None, actor="t", rollout=replace(state, message="x"),
                       expect_generation=state.generation, request_id="req-2")
    # the CAS succeeded; its retry must not come back as a conflict with itself
    assert store.commit(epoch=None, actor="t", rollout=replace(state, message="x"),
                        expect_generation=state.generation, request_id="req-2") == gen


def test_retry_after_a_lost_reply_does_not_store_a_revision_twice(redis_client, redis_service):
    """A real lost reply: a proxy forwards the script but drops the connection before the answer."""
    proxy = _ReplyDropper(redis_service.port)
    try:
        client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=5,
                             retry=redis.retry.Retry(redis.backoff.NoBackoff(), 2),
                             retry_on_error=[redis.ConnectionError])
        store = PolicyStore(client)
        proxy.drop_next_reply_to(b"EVALSHA")
        assert store.put_revision(parse_policy(POLICY), POLICY) == 1
        assert proxy.dropped == 1  # the first attempt ran and its reply was lost
        assert redis_client.hlen("{specops}:revisions") == 1 and int(redis_client.get("{specops}:rev:seq")) == 1
        client.close()
    finally:
        proxy.stop()


class _ReplyDropper:
    """TCP proxy to Redis that can drop the reply to the next command containing a marker."""

    def __init__(self, upstream_port: int) -> None:
        import socket

        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.marker: bytes | None = None
        self.dropped = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_next_reply_to(self, marker: bytes) -> None:
        self.marker = marker

    def _accept(self) -> None:
        import socket

        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            up = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(conn, up), daemon=True).start()

    def _pump(self, conn, up) -> None:
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                up.sendall(data)
                reply = up.recv(65536)
                if self.marker is not None and self.marker in data:
                    self.marker = None
                    self.dropped += 1
                    return  # the command ran in Redis; the client never hears back
                conn.sendall(reply)
        except OSError:
            return
        finally:
            conn.close()
            up.close()

    def stop(self) -> None:
        self._stop.set()
        self.listener.close()


def test_lease_is_kept_through_a_tick_longer_than_its_ttl(redis_client):
    store = PolicyStore(redis_client)
    machine.start_rollout(store, parse_policy(POLICY), POLICY)
    lease = LeaderLease(redis_client, store.lease_name, ttl_ms=400)
    keeper = LeaseKeeper(lease)

    class SlowSource:  # a slow Prometheus query: 3 lease TTLs
        def read(self, request_class, window_s):
            time.sleep(0.6)
            return Reading(None)

    ctl = Controller(store, SlowSource(), lease=lease, keeper=keeper, registry=CollectorRegistry())
    rival = LeaderLease(redis_client, store.lease_name, ttl_ms=400)
    keeper.start()
    try:
        ctl.tick()
        assert not rival.try_acquire() and lease.is_leader and lease.epoch == 1
    finally:
        keeper.stop(release=True)
    assert rival.try_acquire() and rival.epoch == 2  # released on stop: the standby takes over at once
    with pytest.raises(ValueError, match="renew_every_s"):
        LeaseKeeper(lease, renew_every_s=0.3)  # could not renew twice within the lease's 0.36 s validity


def test_run_rejects_an_interval_that_cannot_keep_the_lease(redis_url):
    from click.testing import CliRunner

    from specops.cli import main

    result = CliRunner().invoke(main, ["controller", "run", "--redis", redis_url, "--webhook-token", "t",
                                       "--interval", "20", "--lease-ttl-ms", "15000", "--run-for", "0"])
    assert result.exit_code == 2 and "cannot keep a 15000 ms lease" in result.output


def test_standby_takes_a_killed_leaders_lease_within_a_tenth_of_its_validity(redis_client):
    """The leader stops renewing without releasing (SIGKILL): the standby's keeper, trying every
    tenth of the validity, leads within ttl + that tenth of the kill, not ttl + a renewal period."""
    name = "{specops}:leader-standby-test"
    leader = LeaderLease(redis_client, name, ttl_ms=1000)
    assert leader.try_acquire()
    killed_at = time.monotonic()  # the leader renewed just now and never again
    standby = LeaseKeeper(LeaderLease(redis_client, name, ttl_ms=1000))
    assert standby.standby_every_s <= 0.1 < standby.renew_every_s
    standby.start()
    try:
        deadline = killed_at + 3.0
        while not standby.lease.is_leader and time.monotonic() < deadline:
            time.sleep(0.005)
        took = time.monotonic() - killed_at
        assert standby.lease.is_leader
        assert took <= 1.0 + standby.standby_every_s + 0.15, took  # 0.15 s: scheduling slack
    finally:
        standby.stop(release=True)
