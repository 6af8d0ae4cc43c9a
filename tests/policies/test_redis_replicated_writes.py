"""Scripted writes through `ReplicatedWrites` (the Sentinel client with ``wait_replicas``):
refused with nothing applied while the primary lacks online replicas; a replica lost after
that check is caught by ``WAIT``.

Real redis-server processes on loopback: a primary and, where a test needs one, its replica.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from specops.policies import load_policy
from specops.policies import rollout as sm
from specops.policies.errors import StoreUnavailableError
from specops.policies.redis_urls import ReplicatedWrites, online_replicas
from specops.policies.store import PolicyStore
from tests.services import free_port, redis_call, redis_tools, start_redis_node, wait_until

pytestmark = pytest.mark.services

SET = "redis.call('SET', KEYS[1], ARGV[1]) return 1"
V1 = "version: v1\ndefault_class: a\nclasses: [{name: a}]\n"


@pytest.fixture
def primary(tmp_path):
    server, _ = redis_tools()
    svc = start_redis_node(server, free_port(), tmp_path / "primary", name="primary")
    yield svc
    svc.stop()


@pytest.fixture
def replica(tmp_path, primary):
    server, _ = redis_tools()
    svc = start_redis_node(server, free_port(), tmp_path / "replica", name="replica",
                           extra=("--replicaof", "127.0.0.1", str(primary.port)))
    wait_until(lambda: online_replicas(redis_call(primary.port, "INFO", "replication")) == 1,
               "the replica to be online", 30)
    yield svc
    if svc.proc.poll() is None:
        os.kill(svc.proc.pid, signal.SIGCONT)   # in case a test left it stopped
    svc.stop()


def _client(port: int, *, wait_replicas: int = 1, wait_timeout_ms: int = 5000, **kwargs) -> ReplicatedWrites:
    client = ReplicatedWrites(host="127.0.0.1", port=port, socket_timeout=10, **kwargs)
    client.wait_replicas = wait_replicas
    client.wait_timeout_ms = wait_timeout_ms
    return client


def test_online_replicas_counts_only_online_ones_on_a_primary():
    assert online_replicas({"role": "master", "connected_slaves": 2,
                            "slave0": {"ip": "10.0.0.2", "port": 6379, "state": "online"},
                            "slave1": {"ip": "10.0.0.3", "port": 6379, "state": "wait_bgsave"}}) == 1
    assert online_replicas({"role": "master", "connected_slaves": 0}) == 0
    assert online_replicas({"role": "slave", "master_link_status": "up"}) is None


def test_write_without_enough_online_replicas_is_refused_with_nothing_applied(primary):
    client = _client(primary.port, wait_timeout_ms=5000)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="nothing applied") as err:
            client.eval(SET, 1, "k", "v")
        assert "0 online replica(s)" in str(err.value) and "wait_replicas=0" in str(err.value)
        assert time.monotonic() - started < 2.0             # refused at once, not after WAIT's 5 s
        assert client.get("k") is None
        # the store's writes (what `specops policy …` and the controller do) are refused the same way
        store = PolicyStore(client)
        with pytest.raises(StoreUnavailableError, match="wait_replicas=0"):
            sm.start_rollout(store, load_policy(V1), V1, actor="operator")
        assert store.current_revision() is None and store.history() == []
    finally:
        client.close()


def test_write_with_an_online_replica_is_acknowledged_and_on_the_replica(primary, replica):
    client = _client(primary.port)
    try:
        assert client.eval(SET, 1, "k", "v") == 1
        assert redis_call(replica.port, "GET", "k") == "v"
    finally:
        client.close()


def test_more_replicas_asked_for_than_online_is_refused(primary, replica):
    client = _client(primary.port, wait_replicas=2)
    try:
        with pytest.raises(StoreUnavailableError, match="1 online replica\\(s\\) and wait_replicas=2"):
            client.eval(SET, 1, "k", "v")
        assert client.get("k") is None
    finally:
        client.close()


def test_replica_lost_after_the_check_is_caught_by_wait(primary, replica):
    """The primary still counts a frozen replica as online; WAIT then reports the write unacknowledged."""
    client = _client(primary.port, wait_timeout_ms=300)
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailableError, match="applied on the Redis primary .* not acknowledged"):
            client.eval(SET, 1, "k", "v")
        assert client.get("k") == b"v"
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
        client.close()


def test_user_without_info_permission_is_guarded_by_wait_alone(primary):
    redis_call(primary.port, "ACL", "SETUSER", "writer", "on", ">pw", "~*", "&*", "+@all", "-info")
    client = _client(primary.port, wait_timeout_ms=300, username="writer", password="pw")
    try:
        with pytest.raises(StoreUnavailableError, match="applied on the Redis primary .* not acknowledged"):
            client.eval(SET, 1, "k", "v")
        assert client.get("k") == b"v"
    finally:
        client.close()
