"""Two real `specops controller run` processes on one Redis: one leads; kill it, the other takes over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.services import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
TTL_MS = 1000


def _is_leader(port: int) -> bool | None:
    """The controller's own view from its /metrics (None while unreachable)."""
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    for line in body.splitlines():
        if line.startswith("specops_controller_is_leader "):
            return float(line.split()[1]) == 1.0
    return None


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.mark.services
def test_two_controller_processes_one_leads_and_the_other_takes_over(redis_url, redis_client, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECOPS_WEBHOOK_TOKEN": "t0ken"}
    policy = ROOT / "examples" / "policies" / "default.yaml"
    procs: list[tuple[subprocess.Popen, int]] = []
    try:
        for i in range(2):
            port = free_port()
            log = open(tmp_path / f"controller{i}.log", "wb")
            argv = [sys.executable, "-m", "specops.cli", "controller", "run", "--redis", redis_url,
                    "--policy", str(policy), "--interval", "0.2", "--lease-ttl-ms", str(TTL_MS),
                    "--listen", f"127.0.0.1:{port}"]
            proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
            procs.append((proc, port))
            # one at a time: both would otherwise race to bootstrap the --policy revision
            wait_for_port(port, timeout_s=60, proc=proc)

        def one_leader():
            views = [_is_leader(port) for _, port in procs]
            return views if None not in views and sum(views) == 1 else None

        views = _wait(one_leader, 20, "exactly one leader")
        time.sleep(3 * 0.2)                       # a few more ticks: still exactly one
        assert one_leader() == views
        epoch_before = int(redis_client.get("{specops}:leader:epoch"))
        leader, standby = (procs[0], procs[1]) if views[0] else (procs[1], procs[0])

        os.kill(leader[0].pid, signal.SIGKILL)    # dies without releasing the lease
        leader[0].wait(timeout=10)
        killed_at = time.monotonic()
        _wait(lambda: _is_leader(standby[1]), 10, "the standby to lead")
        took = time.monotonic() - killed_at
        # within one lease TTL, plus one tick interval and polling slack
        assert took <= TTL_MS / 1000 + 0.2 + 0.5, f"takeover took {took:.2f}s"
        assert int(redis_client.get("{specops}:leader:epoch")) == epoch_before + 1
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)
