"""The controller's logs: quiet scheduler, JSON lines, one INFO line per decision."""

import io
import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from specops.controller.controller import Decision
from specops.controller.logs import configure_logging, describe, log_decisions, logged
from tests.services import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]

POLICY = """
version: logs-1
default_class: code
classes:
  - name: code
  - name: chat
    match: [{prefix: "chat:"}]
"""


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.getLogger("apscheduler").setLevel(logging.NOTSET)


def test_describe_names_class_kind_change_and_reason():
    d = Decision("code", "adapt", "goodput 120.0 tok/s at 5 vs 100.0 at 4", before={"gamma": 4, "method": "draft"},
                 after={"gamma": 5, "method": "draft"})
    assert describe(d) == "code adapt gamma 4->5: goodput 120.0 tok/s at 5 vs 100.0 at 4"
    assert describe(Decision(None, "rollout.step", "step 1")) == "rollout rollout.step: step 1"


def test_json_lines_carry_the_decision_and_holds_stay_at_debug(restore_logging):
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    decisions = [Decision("code", "adapt", "why", {"gamma": 4}, {"gamma": 5}, {"estimates": {"4": 1.0, "5": 1.2}}),
                 Decision("chat", "hold", "dead band")]
    log_decisions(decisions, revision=3, epoch=7)
    logging.getLogger("apscheduler.executors.default").info("Running job ... executed successfully")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    rec = json.loads(lines[0])
    assert rec["level"] == "info" and rec["logger"] == "specops.decision"
    assert rec["decision"]["class"] == "code" and rec["decision"]["revision"] == 3 and rec["decision"]["epoch"] == 7
    assert rec["decision"]["inputs"]["estimates"] == {"4": 1.0, "5": 1.2}


def test_debug_level_shows_holds_and_scheduler(restore_logging):
    out = io.StringIO()
    configure_logging("text", "debug", stream=out)
    logged(lambda: [Decision("chat", "hold", "dead band")], lambda: (1, None))()
    logging.getLogger("apscheduler.executors.default").info("Running job")
    text = out.getvalue()
    assert "chat hold: dead band" in text and "Running job" in text


def test_bad_format_is_refused():
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml")


def test_controller_run_json_logs_are_quiet_and_structured(redis_client, redis_url, tmp_path):  # flushed Redis
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = free_port()
    argv = [sys.executable, "-m", "specops.cli", "controller", "run", "--policy", str(policy), "--redis", redis_url,
            "--interval", "0.1", "--listen", f"127.0.0.1:{port}", "--webhook-token", "t", "--run-for", "3",
            "--log-format", "json"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        wait_for_port(port, 30, proc)
        payload = {"version": "4", "status": "firing", "alerts": [
            {"status": "firing", "labels": {"alertname": "x", "class": "chat", "rule": "x", "action": "fallback"},
             "fingerprint": "f"}]}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/webhook/alertmanager", data=json.dumps(payload).encode(),
                                     method="POST", headers={"Authorization": "Bearer t",
                                                             "Content-Type": "application/json"})
        for attempt in range(5):  # like Alertmanager: a 5xx (a busy store under load) is retried
            try:
                assert urllib.request.urlopen(req, timeout=5).status == 200
                break
            except urllib.error.HTTPError as exc:
                assert exc.code >= 500 and attempt < 4, exc.read()
                time.sleep(0.5)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is one JSON object
    assert not [r for r in records if r["logger"].startswith("apscheduler") and r["level"] == "info"], lines
    decisions = [r["decision"] for r in records if "decision" in r]
    # ~30 ticks ran (holds: not logged at INFO); the webhook's fallback is logged exactly once
    assert [(d["class"], d["kind"]) for d in decisions] == [("chat", "fallback_on")], lines
    assert decisions[0]["revision"] == 1 and isinstance(decisions[0]["epoch"], int)
    assert decisions[0]["after"]["fallback_active"] is True
