"""`specops chaos --quick` end to end: every scenario runs against real processes and meets its goal;
the secrets it used appear in none of the captured logs."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import redis_server_binary, require_binary, require_module

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.services


def test_chaos_quick_meets_every_goal_and_logs_no_secret(tmp_path):
    redis_server_binary()  # fails (CI) or skips when no redis-server is installed
    require_binary("prometheus")  # the prom-outage scenario's metrics provider
    require_module("schemathesis", "the webhook-fuzz scenario's OpenAPI fuzzing")
    from specops.chaos.suite import SCENARIOS

    api_key, token = "sk-test-" + secrets.token_hex(8), "wh-test-" + secrets.token_hex(8)
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECOPS_CHAOS_API_KEY=api_key, SPECOPS_CHAOS_WEBHOOK_TOKEN=token)
    out, workdir = tmp_path / "chaos.json", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "specops.cli", "chaos", "--quick", "--json", str(out),
                           "--workdir", str(workdir)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, stdin=subprocess.DEVNULL)
    report = json.loads(out.read_text())["scenarios"]
    assert len(report) == len(SCENARIOS), proc.stderr[-3000:]
    failed = [r for r in report if r["met"] is not True]
    assert not failed, json.dumps(failed, indent=1) + proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in report:
        assert set(r) >= {"name", "figures", "goal", "met"} and r["figures"]
    assert "| scenario | figures | goal | met |" in proc.stdout

    logs = {p: p.read_text(errors="replace") for p in workdir.rglob("*.log")}
    assert any("Application startup complete" in text for text in logs.values())  # serve's log was captured
    for text in [*logs.values(), proc.stdout, proc.stderr]:
        assert api_key not in text and token not in text
