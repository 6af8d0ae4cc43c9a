"""Sentinel: a rollout survives the primary's death — the client follows the failover,
nothing acknowledged is lost, and the stale leader's writes are refused on the new primary.

Real processes on loopback: one primary, one replica, three sentinels (quorum 2).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specops.controller.leader import LeaderLease
from specops.policies import StaleEpochError, load_policy
from specops.policies import rollout as sm
from specops.policies.errors import StoreUnavailableError
from specops.policies.redis_backend import close, connect
from specops.policies.store import PolicyStore
from tests.services import free_port, redis_call, start_sentinel_group, wait_until

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[2]
V1 = """\
version: v1
default_class: a
classes:
  - name: a
    gamma: {initial: 4, min: 1, max: 8}
rollout:
  steps:
    - {weight: 10, pause_s: null, analysis: false}
    - {weight: 50, pause_s: null, analysis: false}
"""
V2 = V1.replace("version: v1", "version: v2").replace("initial: 4, min: 1, max: 8", "initial: 3, min: 2, max: 5")
TTL_MS = 2000


@pytest.fixture
def group(tmp_path):
    g = start_sentinel_group(tmp_path)
    yield g
    g.stop()


def _until_available(fn, what: str, timeout_s: float = 30.0):
    """Call ``fn`` until the store stops answering StoreUnavailableError (a failover in progress)."""
    box = []

    def attempt():
        try:
            box.append(fn())
            return True
        except StoreUnavailableError:
            return False

    wait_until(attempt, what, timeout_s)
    return box[-1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "specops.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


def test_failover_mid_rollout_loses_nothing_acknowledged_and_fences_the_stale_leader(group):
    url = group.url()                                   # wait_replicas=1: a write counts once the replica has it
    old_primary = group.primary.port
    a, b = connect(url), connect(url)
    try:
        store_a, store_b = PolicyStore(a), PolicyStore(b)
        lease_a = LeaderLease(a, name=store_a.lease_name, ttl_ms=TTL_MS)
        assert lease_a.try_acquire()
        epoch_a = lease_a.epoch
        sm.start_rollout(store_a, load_policy(V1), V1, epoch=epoch_a, actor="a")
        sm.start_rollout(store_a, load_policy(V2), V2, epoch=epoch_a, actor="a")
        acked_state = sm.promote(store_a, epoch=epoch_a, actor="a")            # mid-rollout: step 1 of 2
        acked_ids = [store_a.append_audit({"kind": "tick", "n": i}, epoch=epoch_a) for i in range(20)]
        assert (acked_state.phase, acked_state.step_index, acked_state.weight) == ("progressing", 1, 50)

        os.kill(group.primary.proc.pid, signal.SIGKILL)    # the primary dies with no warning
        group.primary.proc.wait(timeout=10)
        new_primary = wait_until(lambda: (p := group.primary_port()) != old_primary and p, "a failover", 60)
        assert new_primary == group.replicas[0].port

        # The client follows the failover; everything acknowledged before the kill is there.
        state = _until_available(store_a.rollout_state, "the store on the new primary")
        assert a.connection_pool.get_master_address()[1] == new_primary
        assert (state.revision, state.step_index, state.weight, state.generation) == \
            (acked_state.revision, 1, 50, acked_state.generation)
        assert (store_a.current_revision(), store_a.canary_revision()) == (1, 2)
        assert [r.policy.version for r in store_a.history()] == ["v1", "v2"]
        ids = {e["id"] for e in store_a.read_audit(count=100)}
        assert set(acked_ids) <= ids

        # The new primary has no replica yet: writes are refused before anything is applied,
        # naming the setting that would allow them ...
        with pytest.raises(StoreUnavailableError, match="nothing applied.*wait_replicas=0"):
            store_a.append_audit({"kind": "tick", "n": "unreplicated"}, epoch=epoch_a)
        assert "unreplicated" not in {str(e.get("n")) for e in store_a.read_audit(count=100)}
        # ... and an operator's command says so in one line (the rollout stays at step 1, checked below)
        out = _cli("policy", "promote", "--redis", url)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
        assert "nothing applied" in out.stderr and "wait_replicas=0" in out.stderr, out.stderr

        # The old primary comes back empty (a rescheduled pod) and the sentinels make it a replica.
        group.restart(group.primary)
        wait_until(lambda: redis_call(group.primary.port, "INFO", "replication").get("master_link_status") == "up",
                   "the old primary to rejoin as a replica", 60)

        # A standby takes the lease once the old tenure's TTL ran out: epoch + 1 ...
        lease_b = LeaderLease(b, name=store_b.lease_name, ttl_ms=TTL_MS)
        wait_until(lambda: _until_available(lease_b.try_acquire, "lease b"), "the standby to lead", 30)
        assert lease_b.epoch == epoch_a + 1
        # ... and the old leader, still holding epoch_a, cannot write on the new primary.
        with pytest.raises(StaleEpochError):
            sm.promote(store_a, epoch=epoch_a, actor="a")
        assert store_b.rollout_state().step_index == 1          # the refused write changed nothing
        done = sm.promote(store_b, epoch=lease_b.epoch, actor="b")
        assert (done.phase, store_b.current_revision(), store_b.canary_revision()) == ("healthy", 2, None)
    finally:
        close(a)
        close(b)

    # Every command taking --redis reaches the promoted primary through the sentinels.
    out = _cli("policy", "status", "--redis", url)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "healthy" in out.stdout and "2" in out.stdout, out.stdout
    out = _cli("policy", "history", "--redis", url)
    assert out.returncode == 0 and "v1" in out.stdout and "v2" in out.stdout, out.stdout + out.stderr


def test_sentinel_url_errors_are_one_readable_line(group):
    with pytest.raises(StoreUnavailableError, match="cannot reach Redis at redis\\+sentinel://.*no-such-service"):
        connect(group.url().replace(group.service, "no-such-service"), timeout_s=1.0)
    dead = free_port()
    with pytest.raises(StoreUnavailableError, match=f"cannot reach Redis at redis\\+sentinel://127.0.0.1:{dead}/"):
        connect(f"redis+sentinel://127.0.0.1:{dead}/{group.service}", timeout_s=1.0)


def test_controller_process_continues_the_rollout_on_the_promoted_replica(group, tmp_path):
    """`specops controller run --redis redis+sentinel://…` advances a canary across the primary's death."""
    url = group.url()
    steps = "rollout:\n  steps:\n    - {weight: 10, pause_s: 3, analysis: false}\n" \
            "    - {weight: 50, pause_s: 3, analysis: false}\n"
    v1, v2 = tmp_path / "v1.yaml", tmp_path / "v2.yaml"
    v1.write_text(V1.split("rollout:")[0] + steps)
    v2.write_text(V2.split("rollout:")[0] + steps)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECOPS_WEBHOOK_TOKEN": "t0ken"}
    log = open(tmp_path / "controller.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "specops.cli", "controller", "run", "--redis", url,
                             "--policy", str(v1), "--interval", "0.3", "--lease-ttl-ms", "2000",
                             "--listen", f"127.0.0.1:{port}"], env=env, cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT)
    client = connect(url)
    try:
        store = PolicyStore(client)
        wait_until(lambda: store.current_revision() == 1, "the controller to bootstrap v1", 60)
        out = _cli("policy", "rollout", str(v2), "--redis", url)
        assert out.returncode == 0, out.stdout + out.stderr
        wait_until(lambda: store.rollout_state().step_index == 1, "the controller to advance to step 1", 30)
        before = {e["id"] for e in store.read_audit(count=1000)}

        os.kill(group.primary.proc.pid, signal.SIGKILL)
        group.primary.proc.wait(timeout=10)
        wait_until(lambda: group.primary_port() == group.replicas[0].port, "a failover", 60)
        group.restart(group.primary)            # back as a replica, so writes are acknowledged again

        try:
            state = wait_until(lambda: (s := _until_available(store.rollout_state, "the store")).phase == "healthy"
                               and s, "the controller to finish the rollout on the new primary", 90)
        except TimeoutError as exc:
            logs = [tmp_path / "controller.log", *sorted(tmp_path.glob("*/*.log"))]
            raise AssertionError(f"{exc}\n" + "\n".join(f"--- {p.name} ---\n" + p.read_text(errors="replace")[-3000:]
                                                        for p in logs)) from exc
        assert (state.revision, store.current_revision(), store.canary_revision()) == (2, 2, None)
        audit = store.read_audit(count=1000)
        assert before <= {e["id"] for e in audit}                       # nothing acknowledged was lost
        after = [e["kind"] for e in audit if e["id"] not in before]
        assert "rollout.complete" in after, f"no rollout write after the failover: {after}"
        assert proc.poll() is None, (tmp_path / "controller.log").read_text()[-3000:]
    finally:
        close(client)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()


def test_serving_client_follows_the_sentinels_primary(group):
    """`specops serve` / `sidecar` read the policy through `serving_redis`: a sentinel URL gives
    the current primary's state (the fail-static cache loads it), not a connection error."""
    from specops.policies.live import LivePolicy, serving_redis

    admin = connect(group.url())
    try:
        sm.start_rollout(PolicyStore(admin), load_policy(V1), V1, actor="test")
    finally:
        close(admin)
    client = serving_redis(group.url(), timeout_s=2.0)
    live = LivePolicy(PolicyStore(client), reconcile_s=60.0, subscribe=False)
    try:
        live.poll(force=True)
        assert live.stable_revision == 1 and not live.stale
        assert live.settings_for("a").gamma == 4
    finally:
        live.close()
        client.close()
