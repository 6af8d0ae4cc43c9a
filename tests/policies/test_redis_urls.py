"""Sentinel / Cluster URL parsing, password redaction, the hash-tagged key layout and its migration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specops.policies import load_policy
from specops.policies import rollout as sm
from specops.policies.errors import StoreUnavailableError
from specops.policies.redis_backend import connect, redact
from specops.policies.redis_urls import parse
from specops.policies.store import PolicyStore
from specops.telemetry.keyspace import LEGACY_STATE_SUFFIXES, key_prefix, migrate_legacy_keys

ROOT = Path(__file__).resolve().parents[2]
TEXT = "version: e1\ndefault_class: a\nclasses: [{name: a}]\n"


def test_sentinel_url_with_every_part():
    t = parse("rediss+sentinel://alice:s%40cret@[::1]:26379,s2.example:26380/mymaster/3"
              "?ssl_ca_certs=/ca.pem&wait_replicas=2&wait_timeout_ms=250&sentinel_password=x")
    assert t.sentinel and t.tls
    assert t.hosts == (("::1", 26379), ("s2.example", 26380))
    assert (t.username, t.password, t.service, t.db) == ("alice", "s@cret", "mymaster", 3)
    assert t.options == {"ssl_ca_certs": "/ca.pem", "wait_replicas": "2", "wait_timeout_ms": "250",
                         "sentinel_password": "x"}


def test_cluster_url():
    t = parse("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7000")
    assert not t.sentinel and not t.tls and t.db == 0 and t.password == "pw" and t.username is None
    assert t.hosts == (("10.0.0.1", 7000), ("10.0.0.2", 7000))
    assert parse("redis+cluster://h:7000/0").db == 0


@pytest.mark.parametrize("url, why", [
    ("redis+sentinel://h:26379", "/service_name"),
    ("redis+sentinel://h:26379/m/1/2", "/service_name"),
    ("redis+sentinel://h/m", "'h' is not host:port"),
    ("redis+sentinel://h:99999/m", "is not host:port"),
    ("redis+sentinel:///m", "no host:port"),
    ("redis+sentinel://h:1/m/x", "database 'x'"),
    ("redis+sentinel://h:1/m?wait_replicas=-1", "wait_replicas must be"),
    ("redis+sentinel://h:1/m?ssl_ca_certs=/ca", "need the rediss+ form"),
    ("redis+sentinel://h:1/m?socket_timeout=3", "unknown option(s) socket_timeout"),
    ("redis+cluster://h:7000/2", "database 0 only"),
    ("redis+cluster://h:7000?wait_replicas=1", "unknown option(s) wait_replicas"),
    ("redis+cluster://[::1:7000", "unclosed '['"),
])
def test_bad_urls_name_the_problem(url, why):
    with pytest.raises(StoreUnavailableError) as info:
        parse(url)
    assert why in str(info.value)


def test_connect_rejects_unknown_schemes_listing_the_known_ones():
    with pytest.raises(StoreUnavailableError, match="redis\\+sentinel://, rediss\\+sentinel://, redis\\+cluster://"):
        connect("memcached://h:1")


def test_redact_hides_every_password():
    assert redact("redis+sentinel://u:pw@h1:1,h2:2/m?sentinel_password=sp&wait_replicas=1") == \
        "redis+sentinel://u:***@h1:1,h2:2/m?sentinel_password=***&wait_replicas=1"
    assert redact("redis+cluster://:pw@h:7000") == "redis+cluster://:***@h:7000"
    assert redact("unix://:pw@/run/redis.sock") == "unix://:***@/run/redis.sock"
    assert redact("redis://h:1/0") == "redis://h:1/0"
    with pytest.raises(StoreUnavailableError) as info:
        parse("redis+sentinel://u:topsecret@h:1/m?bogus=1")
    assert "topsecret" not in str(info.value)


def test_key_prefix_is_a_hash_tag():
    assert key_prefix("specops") == "{specops}" and key_prefix("specops:canary") == "{specops:canary}"
    for bad in ("", "a b", "a{b", "a}b"):
        with pytest.raises(ValueError, match="invalid namespace"):
            key_prefix(bad)


def test_store_and_lease_keys_carry_the_tag(redis_client):
    store = PolicyStore(redis_client, namespace="team")
    assert all(k.startswith("{team}:") for k in store.keys.values())
    assert store.lease_name == "{team}:leader" and store.channel.startswith("{team}:")


def test_migrate_legacy_keys_then_the_store_reads_the_old_state(redis_client):
    store = PolicyStore(redis_client)
    sm.start_rollout(store, load_policy(TEXT), TEXT)
    state_keys = [k.decode() for k in redis_client.keys("{specops}:*")]
    for key in state_keys:                              # write the state under the pre-tag names
        redis_client.rename(key, key.replace("{specops}:", "specops:"))
    assert redis_client.keys("{specops}:*") == [] and PolicyStore(redis_client).current_revision() is None

    renamed = migrate_legacy_keys(redis_client, "specops")
    durable = {k.replace("{specops}:", "specops:") for k in state_keys if ":request:" not in k}   # those expire
    assert {old for old, _ in renamed} == durable
    assert all(old.removeprefix("specops:") in LEGACY_STATE_SUFFIXES for old, _ in renamed)
    again = PolicyStore(redis_client)
    assert again.current_revision() == 1 and again.get_revision(1).text == TEXT
    assert migrate_legacy_keys(redis_client, "specops") == []          # idempotent

    redis_client.set("specops:current", "7")                           # both layouts: refuse, change nothing
    with pytest.raises(ValueError, match="both layouts"):
        migrate_legacy_keys(redis_client, "specops")
    assert redis_client.get("specops:current") == b"7" and again.current_revision() == 1


def test_migrate_keys_command(redis_url, redis_client):
    redis_client.set("specops:rev:seq", "4")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "specops.cli", "policy", "migrate-keys", "--redis", redis_url],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "specops:rev:seq -> {specops}:rev:seq" in out.stdout and "1 key(s) renamed" in out.stdout
    assert redis_client.get("{specops}:rev:seq") == b"4"
