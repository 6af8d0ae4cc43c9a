"""The processes ``specops bench serve`` starts: ``specops serve`` and ``specops controller run``, their
readiness, pausing (SIGSTOP / SIGCONT) and stopping."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from specops.bench.serve.config import BenchServeError, ServeBenchConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> dict[str, Any]:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchServeError(f"the server exited with code {proc.returncode}{_log_tail(proc)}")
        try:
            r = httpx.get(f"{url}/readyz", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise BenchServeError(f"{url} not ready after {timeout_s:.0f}s{_log_tail(proc)}")


def _log_tail(proc: subprocess.Popen | None, lines: int = 5) -> str:
    """'; it said: ...' from the last lines of a started process's log (``proc.log_path``), so a
    bad --server-arg is named, not just an exit code."""
    path = getattr(proc, "log_path", None)
    if path is None or not Path(path).exists():
        return ""
    tail = Path(path).read_text(errors="replace").strip().splitlines()[-lines:]
    return "; it said: " + " | ".join(line.strip() for line in tail if line.strip()) if tail else ""


def _pause(proc: subprocess.Popen | None) -> None:
    """One server: stop the adaptive mode's controller (SIGSTOP) while other modes hold the server."""
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGSTOP)


def _resume(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)


def _stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)  # a paused controller (`_pause`) would not act on SIGTERM
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout_s)


def _start_controller(cfg: ServeBenchConfig, redis_url: str, workdir: Path,
                      namespace: str | None = None, paused: bool = False) -> subprocess.Popen:
    """``specops controller run`` against ``namespace``; ``paused``: it will be stopped (`_pause`) between
    its mode's cells, for longer than a 15 s lease, so its lease lasts 10 minutes (it is the only
    controller there: nobody else could take the lead meanwhile)."""
    argv = [sys.executable, "-m", "specops.cli", "controller", "run", "--redis", redis_url, "--namespace",
            namespace or cfg.namespace, "--interval", str(cfg.controller_interval_s), "--window",
            str(cfg.window_s), "--listen", f"127.0.0.1:{_free_port()}",
            "--lease-ttl-ms", str(int(max(600_000 if paused else 15_000, 4000 * cfg.controller_interval_s)))]
    env = dict(os.environ, SPECOPS_WEBHOOK_TOKEN=secrets.token_hex(16))
    log = open(workdir / "controller.log", "wb")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _start_server(cfg: ServeBenchConfig, redis_url: str, workdir: Path, max_batch: int,
                  namespace: str | None = None, name: str = "serve") -> tuple[subprocess.Popen, str]:
    port = _free_port()
    argv = [sys.executable, "-m", "specops.cli", "serve", "--port", str(port), "--redis", redis_url,
            "--namespace", namespace or cfg.namespace, "--max-batch", str(max_batch), "--log-level", "warning", *cfg.server_args]
    log_path = workdir / f"{name}.log"
    run_dir = workdir / name
    run_dir.mkdir(exist_ok=True)
    proc = subprocess.Popen(argv, cwd=run_dir, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    proc.log_path = log_path  # type: ignore[attr-defined]  # read by _wait_ready on failure
    return proc, f"http://127.0.0.1:{port}"
