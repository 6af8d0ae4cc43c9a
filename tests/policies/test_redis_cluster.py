"""Redis Cluster: a namespace's keys share one hash slot, so every multi-key script and
transaction runs — rollout, fencing, audit, telemetry, settings notifications — against
a real 3-primary cluster (`redis-server --cluster-enabled yes` + `redis-cli --cluster create`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis as redis_py
from redis.exceptions import RedisClusterException

from specops.controller.leader import LeaderLease
from specops.policies import StaleEpochError, load_policy
from specops.policies import rollout as sm
from specops.policies.redis_backend import close, connect
from specops.policies.store import PolicyStore
from specops.policies.live import LivePolicy
from specops.telemetry.redis_metrics import RedisPublisher, RedisWindowReader
from tests.services import start_cluster, wait_until
from tests.telemetry.helpers import make_record

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
"""
V2 = V1.replace("version: v1", "version: v2").replace("initial: 4, min: 1, max: 8", "initial: 3, min: 2, max: 5")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


def _all_keys(cluster) -> dict[int, list[str]]:
    """Every key on every node, by node port."""
    out = {}
    for node in cluster.nodes:
        client = redis_py.Redis(port=node.port, decode_responses=True)
        out[node.port] = sorted(client.keys("*"))
        client.close()
    return out


def test_the_whole_state_machine_runs_on_a_cluster_in_one_slot(cluster):
    client = connect(cluster.url())
    try:
        client.flushall()
        store = PolicyStore(client)
        lease = LeaderLease(client, name=store.lease_name, ttl_ms=5000)
        assert lease.try_acquire()
        watcher = LivePolicy(store, reconcile_s=3600)
        sm.start_rollout(store, load_policy(V1), V1, epoch=lease.epoch)
        sm.start_rollout(store, load_policy(V2), V2, epoch=lease.epoch)
        done = sm.promote(store, epoch=lease.epoch)
        assert (done.phase, store.current_revision(), store.canary_revision()) == ("healthy", 2, None)
        assert store.effective()["a"].revision == 2
        # the PUBLISH inside the commit script reaches a subscriber on the cluster
        assert wait_until(watcher.poll, "the settings notification", 10) and watcher.settings_for("a").revision == 2
        watcher.close()
        store.append_audit({"kind": "tick", "n": 1}, epoch=lease.epoch)
        assert [e["kind"] for e in store.read_audit()][-1] == "tick"

        publisher = RedisPublisher(client, "pod-0")
        for _ in range(3):
            publisher.publish(make_record("a"))
        assert RedisWindowReader(client).window("a", 60).requests == 3

        # fencing across a change of leader, on the cluster
        old_epoch = lease.epoch
        lease.release()
        successor = LeaderLease(client, name=store.lease_name, ttl_ms=5000)
        assert successor.try_acquire() and successor.epoch == old_epoch + 1
        with pytest.raises(StaleEpochError):
            store.append_audit({"kind": "tick", "n": 2}, epoch=old_epoch)

        keys = _all_keys(cluster)
        holders = [port for port, names in keys.items() if names]
        assert len(holders) == 1, f"the namespace is spread over nodes: {keys}"
        names = keys[holders[0]]
        assert {"{specops}:current", "{specops}:rollout", "{specops}:audit", "{specops}:leader:epoch"} <= set(names)
        assert all(n.startswith("{specops}:") for n in names), names
        assert len({client.keyslot(n) for n in names}) == 1
    finally:
        close(client)


def test_without_the_hash_tag_the_cluster_refuses_a_multi_key_script(cluster):
    """Why the tags exist: the pre-tag key names land in different slots."""
    client = connect(cluster.url())
    try:
        assert client.keyslot("specops:current") != client.keyslot("specops:rollout")
        with pytest.raises((RedisClusterException, redis_py.ResponseError)):
            client.eval("return redis.call('GET', KEYS[1])", 2, "specops:current", "specops:rollout")
        assert client.eval("return redis.call('GET', KEYS[1])", 2, "{fresh}:current", "{fresh}:rollout") is None
    finally:
        close(client)


def test_policy_cli_on_a_cluster_url(cluster, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECOPS_REDIS": cluster.url(), "SPECOPS_NAMESPACE": "cli-test"}
    policy = tmp_path / "p.yaml"
    policy.write_text(V1)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "specops.cli", "policy", *args], capture_output=True, text=True,
                              timeout=120, env=env, cwd=tmp_path)

    out = cli("rollout", str(policy))
    assert out.returncode == 0, out.stdout + out.stderr
    out = cli("status")
    assert out.returncode == 0 and "revision 1" in out.stdout, out.stdout + out.stderr
    client = connect(cluster.url())
    try:
        assert PolicyStore(client, namespace="cli-test").current_revision() == 1
        assert client.keyslot("{cli-test}:current") == client.keyslot("{cli-test}:audit")
    finally:
        close(client)


def test_cluster_url_errors(cluster):
    from specops.policies.errors import StoreUnavailableError
    from tests.services import free_port

    with pytest.raises(StoreUnavailableError, match="database 0 only"):
        connect(cluster.url() + "/3")
    dead = free_port()
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=f"cannot reach Redis at redis\\+cluster://127.0.0.1:{dead}"):
        connect(f"redis+cluster://127.0.0.1:{dead}", timeout_s=1.0)
    assert time.monotonic() - started < 30
