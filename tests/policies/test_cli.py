"""`specops policy ...` through click's CliRunner against a real Redis, plus one real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specops.cli import main
from specops.policies.store import PolicyStore
from specops.telemetry.records import DecodeRecord
from specops.telemetry.redis_metrics import RedisPublisher

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "policies"


@pytest.fixture
def run(redis_url, redis_client):
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(main, ["policy", *args], env={"SPECOPS_REDIS": redis_url}, catch_exceptions=False)

    return invoke


def test_validate_ok_and_every_error(tmp_path, run):
    ok = run("validate", str(EXAMPLES / "default.yaml"), str(EXAMPLES / "chat.yaml"),
             str(EXAMPLES / "code-assistant.yaml"))
    assert ok.exit_code == 0, ok.output
    assert ok.output.count(": ok (version") == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefault_class: x\nclasses:\n  - name: a\n    method: warp\n    gamma: {initial: 9, min: 1, max: 4}\n")
    res = run("validate", str(bad))
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert f"{bad}:5: classes[0].method: input should be 'draft', 'medusa', 'ngram', 'eagle', 'auto' or 'off' (got 'warp')" in lines
    assert f"{bad}:6: classes[0].gamma: initial (9) must lie within min..max (1..4)" in lines
    assert "Traceback" not in res.output


def test_rollout_lifecycle(run, redis_client):
    default, chat = str(EXAMPLES / "default.yaml"), str(EXAMPLES / "chat.yaml")
    assert "no current revision" in run("diff", default).output
    res = run("rollout", default)
    assert res.exit_code == 0 and "healthy" in res.output
    assert run("status").exit_code == 0
    assert "no changes against revision 1" in run("diff", default).output
    diff = run("diff", chat).output
    assert "-version: 2026-12-04.1" in diff and "+version: chat-2026.11.1" in diff and "+- name: creative" in diff

    res = run("rollout", chat)
    assert res.exit_code == 0 and "10% on canary" in res.output
    assert run("status").exit_code == 3
    res = run("rollout", chat)
    assert res.exit_code == 1 and "Error: revision 2 is being rolled out" in res.output
    assert "30% on canary" in run("promote").output
    res = run("abort")
    assert res.exit_code == 0 and "aborted" in res.output
    assert run("status").exit_code == 1

    run("rollout", chat)
    assert "healthy" in run("promote", "--full").output
    store = PolicyStore(redis_client)
    assert store.current_revision() == 3 and set(store.effective()) == {
        "factual", "summarise", "creative", "chat-first", "chat-followup", "chat"}
    hist = run("history").output.splitlines()
    assert len(hist) == 4 and "current" in hist[3] and hist[3].split()[0] == "3"
    res = run("rollback")
    assert res.exit_code == 0 and "rolled back from revision 3 to 1" in res.output
    assert store.current_revision() == 1 and "code" in store.effective()
    assert run("rollback", "--to-revision", "77").output.strip() == "Error: no policy revision 77"


def test_status_watch_times_out_while_progressing_and_settles(run, redis_url):
    run("rollout", str(EXAMPLES / "default.yaml"))
    run("rollout", str(EXAMPLES / "chat.yaml"))
    res = run("status", "--wait", "--timeout", "0.3", "--interval", "0.05")
    assert res.exit_code == 3 and "timed out" in res.output
    run("promote", "--full")
    res = run("status", "--wait", "--timeout", "5", "--json")
    assert res.exit_code == 0 and '"phase": "healthy"' in res.output


def test_status_without_rollout_and_bad_redis(run):
    res = run("status")
    assert res.exit_code == 1 and res.output.strip() == "Error: no policy has been rolled out yet"
    runner = CliRunner()
    res = runner.invoke(main, ["policy", "history", "--redis", "redis://:secret@127.0.0.1:1/0"])
    assert res.exit_code == 1 and "cannot reach Redis" in res.output and "secret" not in res.output


def test_dry_run_evaluates_live_metrics_and_changes_nothing(run, redis_client):
    run("rollout", str(EXAMPLES / "default.yaml"))
    pub = RedisPublisher(redis_client, pod="pod-1")
    for _ in range(5):  # code class: acceptance 0.2 < 0.5 with 200 drafted tokens -> would fire
        pub.publish(DecodeRecord(request_class="code", method="draft", new_tokens=60, drafted=40, accepted=8,
                                 accepted_per_pos=[5, 2, 1, 0], target_forwards=52, draft_s=0.2, verify_s=0.8,
                                 wall_s=1.0, plain_s_estimate=1.2, token_latencies_s=[0.01] * 60,
                                 head_predictions=[], head_correct=[], gamma=4, heads=0))
    store = PolicyStore(redis_client)
    before = (store.history(), store.effective(), store.rollout_state())
    res = run("rollout", "--dry-run", str(EXAMPLES / "default.yaml"))
    assert res.exit_code == 0, res.output
    fired = [ln for ln in res.output.splitlines() if "WOULD FIRE" in ln]
    assert any("low-acceptance" in ln and "code" in ln and "fallback" in ln for ln in fired), res.output
    assert not any("general" in ln for ln in fired)
    assert "nothing was applied" in res.output
    assert (store.history(), store.effective(), store.rollout_state()) == before


def test_subprocess_validate_bad_file_exit_code_and_lines(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("version: v\ndefault_class: a\nclasses:\n  - name: a\n    gamma: {initial: 2, min: 3, max: 4}\n"
                   "alerts:\n  - {name: r, metric: speedup, op: '=', threshold: 1}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "specops.cli", "policy", "validate", str(bad)], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"{bad}:5: classes[0].gamma: initial (2) must lie within min..max (3..4)",
        f"{bad}:7: alerts[0].op: input should be '<', '<=', '>' or '>=' (got '=')",
    ]
    assert "Traceback" not in proc.stderr


def test_missing_file_is_one_clear_line(run, tmp_path):
    missing = tmp_path / "nope.yaml"
    for args in (("validate", str(missing)), ("rollout", str(missing)), ("diff", str(missing))):
        res = run(*args)
        assert res.exit_code == 1
        assert res.output.strip() == f"{missing}:0: <root>: cannot read file: No such file or directory"


def test_embedded_state_dir_persists_between_invocations(tmp_path):
    runner = CliRunner()
    env = {"SPECOPS_STATE_DIR": str(tmp_path / "state"), "SPECOPS_REDIS": ""}
    res = runner.invoke(main, ["policy", "rollout", str(EXAMPLES / "default.yaml")], env=env, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "state" / "specops.rdb").exists()
    (settings_file,) = tmp_path.glob("state/*.settings")
    pidfile = Path(json.loads(settings_file.read_text())["pidfile"])
    assert not pidfile.exists(), "embedded redis-server still running (its pidfile is removed on clean shutdown)"
    res = runner.invoke(main, ["policy", "history"], env=env, catch_exceptions=False)
    assert res.exit_code == 0 and "current" in res.output and "2026-12-04.1" in res.output
    assert not Path(json.loads(settings_file.read_text())["pidfile"]).exists()
