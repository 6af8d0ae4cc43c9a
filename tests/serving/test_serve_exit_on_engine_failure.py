"""``specops serve`` whose engine thread fails: the request in flight gets the 500, then the
process exits non-zero (for its supervisor to start a fresh one), saying why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.services import free_port

ROOT = Path(__file__).resolve().parents[2]

# `specops serve` with the models replaced by an engine whose first step raises
SCRIPT = """
import sys
from specops.server import server
from tests.serving.fake_engine import FakeEngine, engine_client
server.build_engine_client = lambda *args: engine_client(FakeEngine(step_error=RuntimeError("injected")))
from specops.cli import main
sys.argv = ["specops"] + sys.argv[1:]
main()
"""


def test_serve_exits_non_zero_after_an_engine_failure(redis_url, tmp_path):
    port = free_port()
    argv = [sys.executable, "-c", SCRIPT, "serve", "--port", str(port), "--redis", redis_url, "--namespace",
            "engine-failure", "--log-level", "warning"]
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not ready after 120 s\n" + log.read_text()
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        assert proc.wait(timeout=60) == 1
        out = log.read_text()
        assert "the engine failed: RuntimeError: injected" in out
        assert "exiting for a supervisor to restart the server" in out
        assert "Traceback" in out  # the engine thread's failure is logged with its traceback
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
