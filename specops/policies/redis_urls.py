"""Highly available Redis URLs: Sentinel-managed primaries and Redis Cluster.

``redis+sentinel://[[user]:password@]host:port[,host:port…]/service_name[/db][?options]``
    The sentinels at ``host:port…`` name the primary of ``service_name``; the client
    asks them again whenever its connection to the primary fails, so it follows
    failovers. ``user``/``password`` authenticate to the Redis servers.
``rediss+sentinel://…``
    The same over TLS, to the sentinels and to the primary.
``redis+cluster://[[user]:password@]host:port[,host:port…][?options]``  (``rediss+cluster``: TLS)
    Any reachable nodes of the cluster; the client learns the slot map from them. Only
    database 0 exists in a cluster. Every key of one specops namespace shares one hash
    slot (:mod:`specops.telemetry.keyspace`), so the multi-key scripts run on one shard.

Options (query string):

``wait_replicas=N`` (Sentinel only; default 1)
    Every scripted write (``EVAL``/``EVALSHA``: all state writes, the lease) returns
    only after ``N`` replicas acknowledged it (Redis ``WAIT``), so an acknowledged
    write survives the failover to a replica that had it. Before the write the
    primary is asked how many replicas are online (``INFO replication``); with fewer
    than ``N`` the write is not sent and :class:`StoreUnavailableError` says so
    (nothing applied; the message names ``wait_replicas=0``). A replica can still drop
    between that check and the write: then ``WAIT`` times out and the error says the
    write was applied on the primary but not acknowledged (``WAIT`` alone guards the
    writes of an ACL user not allowed ``INFO``). ``0`` turns both off (faster; a
    failover may drop the last writes).
``wait_timeout_ms=M`` (default 1000)
    How long a write waits for those acknowledgements.
``sentinel_username``, ``sentinel_password``
    When the sentinels themselves require AUTH.
``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``
    TLS settings for the ``rediss+…`` forms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from specops.policies.errors import StoreUnavailableError

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_WRITE_SCRIPTS = ("EVAL", "EVALSHA")


@dataclass(frozen=True)
class MultiHostURL:
    """A parsed ``redis+sentinel://`` or ``redis+cluster://`` URL."""

    scheme: str
    hosts: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    service: str | None = None          # Sentinel: the monitored primary's name
    db: int = 0
    options: dict[str, str] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return self.scheme.startswith("rediss+")

    @property
    def sentinel(self) -> bool:
        return self.scheme in SENTINEL_SCHEMES


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    url = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:@/?]*):[^@/?]*@", r"\1:***@", url)
    return re.sub(r"([?&]sentinel_password=)[^&]*", r"\1***", url)


def _bad(url: str, why: str) -> StoreUnavailableError:
    return StoreUnavailableError(f"bad Redis URL {redact(url)}: {why}")


def _host_port(url: str, text: str) -> tuple[str, int]:
    if text.startswith("["):                       # [v6 address]:port
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep:
            raise _bad(url, f"unclosed '[' in {text!r}")
    else:
        host, _, port_text = text.rpartition(":")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _bad(url, f"{text!r} is not host:port")
    return host, int(port_text)


def parse(url: str) -> MultiHostURL:
    """Parse a Sentinel or Cluster URL; raises :class:`StoreUnavailableError` naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
        raise _bad(url, f"scheme must be one of {', '.join(SENTINEL_SCHEMES + CLUSTER_SCHEMES)}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    if not at:
        hostlist, userinfo = netloc, ""
    username = password = None
    if userinfo:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    hosts = tuple(_host_port(url, h) for h in hostlist.split(",") if h)
    if not hosts:
        raise _bad(url, "no host:port given")
    options = dict(parse_qsl(query, keep_blank_values=True))
    allowed = set(TLS_OPTIONS) | ({"wait_replicas", "wait_timeout_ms", "sentinel_username", "sentinel_password"}
                                  if scheme in SENTINEL_SCHEMES else set())
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise _bad(url, f"unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(allowed))})")
    if any(k in options for k in TLS_OPTIONS) and not scheme.startswith("rediss+"):
        raise _bad(url, "ssl_* options need the rediss+ form")
    parts = [unquote(p) for p in path.split("/") if p]
    service, db = None, 0
    if scheme in SENTINEL_SCHEMES:
        if not parts or len(parts) > 2:
            raise _bad(url, "the path must be /service_name or /service_name/db")
        service = parts[0]
        db_text = parts[1] if len(parts) == 2 else "0"
    else:
        if len(parts) > 1:
            raise _bad(url, "a cluster URL has no path beyond an optional /0")
        db_text = parts[0] if parts else "0"
    if not db_text.isdigit():
        raise _bad(url, f"database {db_text!r} is not a number")
    db = int(db_text)
    if scheme in CLUSTER_SCHEMES and db != 0:
        raise _bad(url, "Redis Cluster has database 0 only")
    for key in ("wait_replicas", "wait_timeout_ms"):
        if key in options and not options[key].isdigit():
            raise _bad(url, f"{key} must be a non-negative integer")
    return MultiHostURL(scheme, hosts, username, password, service, db, options)


def online_replicas(info: dict[str, Any]) -> int | None:
    """Replicas in state ``online`` in a parsed ``INFO replication``; None unless the server is a primary."""
    if info.get("role") != "master":
        return None
    return sum(1 for key, value in info.items()
               if key.startswith("slave") and key[5:].isdigit() and isinstance(value, dict)
               and value.get("state") == "online")


class ReplicatedWrites(redis.Redis):
    """A client whose scripted writes return only once ``wait_replicas`` replicas have them.

    Before a scripted write, ``INFO replication`` on the same connection counts the
    primary's online replicas: with fewer than ``wait_replicas`` the write is not sent
    (:class:`StoreUnavailableError`, nothing applied). After it, ``WAIT`` on the same
    connection (that is what it counts) covers a replica lost in between: a write not
    acknowledged in time raises :class:`StoreUnavailableError` saying it was applied on
    the primary only.
    """

    wait_replicas = 1
    wait_timeout_ms = 1000

    def _send_command_parse_response(self, conn, command_name, *args, **options):
        replicated = self.wait_replicas > 0 and str(command_name).upper() in _WRITE_SCRIPTS
        if replicated:
            conn.send_command("INFO", "replication")
            try:
                online = online_replicas(self.parse_response(conn, "INFO"))
            except redis.ResponseError:  # an ACL user without INFO (@dangerous): WAIT alone guards the write
                online = None
            if online is not None and online < self.wait_replicas:  # not a primary: the write's own error says so
                raise StoreUnavailableError(
                    f"write refused, nothing applied: the Redis primary has {online} online replica(s) and "
                    f"wait_replicas={self.wait_replicas} needs {self.wait_replicas} to acknowledge every write "
                    "(bring a replica back, or set wait_replicas=0 in the Redis URL to accept writes a "
                    "failover may lose)", retry_after_s=1.0)
        result = super()._send_command_parse_response(conn, command_name, *args, **options)
        if replicated:
            conn.send_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            acked = int(self.parse_response(conn, "WAIT"))
            if acked < self.wait_replicas:
                raise StoreUnavailableError(
                    f"write applied on the Redis primary but reached {acked} of {self.wait_replicas} replica(s) "
                    f"within {self.wait_timeout_ms} ms: not acknowledged (it may survive on the primary only, "
                    "or be lost in a failover)", retry_after_s=1.0)
        return result


def _tls_kwargs(target: MultiHostURL) -> dict[str, Any]:
    if not target.tls:
        return {}
    return {"ssl": True, **{k: v for k, v in target.options.items() if k in TLS_OPTIONS}}


def sentinel_client(target: MultiHostURL, timeout_s: float) -> redis.Redis:
    """A client for the primary that ``target``'s sentinels name (re-asked after every connection failure)."""
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    tls = _tls_kwargs(target)
    sentinel_auth = {k.removeprefix("sentinel_"): target.options[k]
                     for k in ("sentinel_username", "sentinel_password") if k in target.options}
    sentinel = Sentinel(list(target.hosts), sentinel_kwargs={**timeouts, **tls, **sentinel_auth}, **timeouts)
    wait = int(target.options.get("wait_replicas", "1"))
    client = sentinel.master_for(target.service, redis_class=ReplicatedWrites if wait else redis.Redis,
                                 db=target.db, username=target.username, password=target.password, **timeouts, **tls)
    if wait:
        client.wait_replicas = wait
        client.wait_timeout_ms = int(target.options.get("wait_timeout_ms", "1000"))
    return client


def cluster_client(target: MultiHostURL, timeout_s: float) -> RedisCluster:
    """A Redis Cluster client that starts from ``target``'s nodes and follows the slot map."""
    nodes = [ClusterNode(host, port) for host, port in target.hosts]
    return RedisCluster(startup_nodes=nodes, username=target.username, password=target.password,
                        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **_tls_kwargs(target))
