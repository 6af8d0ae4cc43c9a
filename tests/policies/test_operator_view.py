"""`specops policy status` per class and `specops policy decisions`, after a real controller acted.

A real Redis (tests/conftest.py); the controller runs with a fake clock on synthetic
windows, so what it decides is known: code's γ goes 2 -> 4 (goodput), a canary is
analysed, chat falls back by webhook alert.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from specops.alerts.webhook import AlertAction
from specops.cli import main
from specops.controller.controller import Controller
from specops.controller.sources import RedisWindowSource
from specops.policies import parse_policy
from specops.policies import rollout as machine
from specops.policies.store import PolicyStore
from specops.telemetry.records import DecodeRecord
from specops.telemetry.redis_metrics import RedisPublisher, RedisWindowReader
from tests.controller.helpers import FakeClock, window

POLICY = """
version: ov1
default_class: code
classes:
  - name: code
    gamma: {initial: 2, min: 1, max: 8}
    adaptation: {mode: goodput, dead_band: 0.03, cooldown_s: 10, max_step: 2, probe_fraction: 0.1}
  - name: chat
    match: [{prefix: "chat:"}]
    gamma: {initial: 4, min: 1, max: 8}
    adaptation: {mode: fixed, probe_fraction: 0.2}
  - name: facts
    match: [{prefix: "q:"}]
    method: medusa
    medusa_heads: {initial: 3, min: 1, max: 4}
    tree_size: {initial: 16, min: 4, max: 32}
  - name: trees
    match: [{prefix: "t:"}]
    method: eagle
    gamma: {initial: 4, min: 1, max: 8}
    tree_size: {initial: 24, min: 4, max: 32}
    eagle_topk: 4
alerts:
  - {name: slower, metric: speedup, op: "<", threshold: 1.0, for_s: 20, min_samples: 100, action: fallback}
"""


def _record(cls: str, stats) -> DecodeRecord:
    return DecodeRecord(cls, "draft", stats.new_tokens, stats.drafted, stats.accepted, list(stats.accepted_per_pos),
                        stats.target_forwards, stats.draft_s, stats.verify_s, stats.wall_s, stats.plain_s_estimate,
                        [], [], [], int(stats.gamma), 0)


@pytest.fixture
def acted(redis_client):
    """A store in which the controller adapted code twice and fell chat back by alert."""
    clock = FakeClock(time.time() - 600)
    store = PolicyStore(redis_client, clock=clock)
    machine.start_rollout(store, parse_policy(POLICY), POLICY)
    pub = RedisPublisher(redis_client, "pod-0", clock=clock)
    ctl = Controller(store, RedisWindowSource(RedisWindowReader(redis_client, clock=clock)), clock=clock,
                     registry=CollectorRegistry(), window_s=10)
    for _ in range(4):
        clock.now = (clock.now // 10 + 1) * 10 + 1
        gamma = store.effective()["code"].gamma
        pub.publish(_record("code", window(0.9, gamma, rounds=2000)))
        clock.now += 8.9
        ctl.tick()
    clock.advance(5)
    assert ctl.apply_alert(AlertAction("fallback", "chat", "slower", "fp1"))
    # live traffic for the status columns, on the real clock
    RedisPublisher(redis_client, "pod-1").publish(_record("code", window(0.8, 4, rounds=200)))
    return store


def invoke(redis_url, *args):
    return CliRunner().invoke(main, ["policy", *args], env={"SPECOPS_REDIS": redis_url}, catch_exceptions=False)


def test_status_json_has_every_class_with_knobs_fallback_and_last_decision(acted, redis_url):
    res = invoke(redis_url, "status", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["phase"] == "healthy" and set(doc["classes"]) == {"code", "chat", "facts", "trees"}
    code, chat, facts = doc["classes"]["code"], doc["classes"]["chat"], doc["classes"]["facts"]
    assert code["method"] == "draft" and code["gamma"] == 4 and code["fallback_active"] is False
    assert code["last_decision"]["kind"] == "adapt" and code["last_decision"]["change"] == "gamma 2 -> 4"
    assert "goodput" in code["last_decision"]["reason"] and code["last_decision"]["epoch"] is None
    assert code["live"]["requests"] == 1 and code["live"]["acceptance_rate"] == pytest.approx(
        window(0.8, 4, rounds=200).acceptance_rate, rel=1e-6)
    assert code["live"]["speedup"] > 1 and code["live"]["tokens_per_s"] > 0
    assert chat["fallback_active"] is True and chat["probe_fraction"] == 0.2
    assert chat["fallback_reason"] == "alert slower (webhook)" and chat["fallback_since"] is not None
    assert chat["last_decision"]["kind"] == "fallback_on" and chat["live"] is None
    assert facts["method"] == "medusa" and facts["medusa_heads"] == 3 and facts["tree_size"] == 16
    assert facts["eagle_topk"] is None and code["eagle_topk"] is None
    trees = doc["classes"]["trees"]
    assert trees["method"] == "eagle" and trees["gamma"] == 4 and trees["tree_size"] == 24 and trees["eagle_topk"] == 4


def test_status_table_shows_rows_and_reasons(acted, redis_url):
    res = invoke(redis_url, "status")
    assert res.exit_code == 0, res.output
    rows = {line.split()[0]: line for line in res.output.splitlines() if line and line.split()[0] in
            ("code", "chat", "facts", "trees")}
    assert "γ 4" in rows["code"] and "adapt" in rows["code"] and "gamma 2 -> 4" in rows["code"]
    assert "on " in rows["chat"] and "p=20%" in rows["chat"] and "fallback_on" in rows["chat"]
    assert "heads 3 tree 16" in rows["facts"]
    assert "γ 4 tree 24 top-4" in rows["trees"]
    assert "chat: fallen back since" in res.output and "alert slower (webhook)" in res.output


def test_dry_run_shows_an_eagle_classes_tree(acted, redis_url, tmp_path):
    changed = tmp_path / "policy.yaml"
    changed.write_text(POLICY.replace("version: ov1", "version: ov2").replace("eagle_topk: 4", "eagle_topk: 6"))
    res = invoke(redis_url, "rollout", "--dry-run", str(changed))
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if line.startswith("trees "))
    assert "eagle gamma=4 tree=24 topk=4" in row and "eagle gamma=4 tree=24 topk=6" in row
    code = next(line for line in res.output.splitlines() if line.startswith("code "))
    assert "topk" not in code and "draft gamma=4" in code


def test_status_watch_redraws_a_bounded_number_of_times(acted, redis_url):
    res = invoke(redis_url, "status", "--watch", "--watch-count", "3", "--interval", "0.05")
    assert res.exit_code == 0, res.output
    assert res.output.count("every 0.05s") == 3 and res.output.count("revision 1: healthy") == 3
    res = invoke(redis_url, "status", "--watch", "--watch-count", "2", "--interval", "0.05", "--json")
    frames = [json.loads(line) for line in res.output.splitlines()]
    assert len(frames) == 2 and all(f["classes"]["chat"]["fallback_active"] for f in frames)
    res = invoke(redis_url, "status", "--watch-count", "2")
    assert res.exit_code == 2 and "--watch-count needs --watch" in res.output


def test_decisions_log_shows_inputs_revision_and_epoch(acted, redis_url):
    res = invoke(redis_url, "decisions")
    assert res.exit_code == 0, res.output
    out = res.output
    assert out.count(" adapt ") == 1 and "gamma 2 -> 4" in out
    assert "estimates (tokens/s by knob value): 1:" in out and "dead-band 3.0%" in out and "expected gain +" in out
    assert "window: 1 requests, acceptance 0.855, speed-up 1.69" in out  # alpha 0.9 at gamma 2: (0.9 + 0.81) / 2
    assert "fallback_on  fallback_active False -> True" in out and "alert: rule slower via webhook" in out
    assert "rollout.start" in out and "revision.created" in out
    lines = [json.loads(x) for x in invoke(redis_url, "decisions", "--json", "--class", "chat").output.splitlines()]
    assert {r["class"] for r in lines} <= {"chat", None}
    fb = [r for r in lines if r["kind"] == "fallback_on"]
    assert len(fb) == 1 and fb[0]["revision"] == 1 and fb[0]["inputs"]["rule"] == "slower"
    assert fb[0]["before"]["fallback_active"] is False and fb[0]["after"]["fallback_active"] is True
    code = [json.loads(x) for x in invoke(redis_url, "decisions", "--json", "--class", "code").output.splitlines()]
    adapt = [r for r in code if r["kind"] == "adapt"][0]
    assert adapt["inputs"]["dead_band"] == 0.03 and adapt["inputs"]["estimates"]["4"] > adapt["inputs"]["estimates"]["2"]
    assert adapt["before"]["gamma"] == 2 and adapt["after"]["gamma"] == 4 and adapt["revision"] == 1


def test_decisions_since_and_bad_duration(acted, redis_url, redis_client):
    time.sleep(1.2)
    res = invoke(redis_url, "decisions", "--since", "1s")
    assert res.exit_code == 0 and res.output.strip() == "no decisions in the last 1s"
    res = invoke(redis_url, "decisions", "--since", "soon")
    assert res.exit_code == 2 and "positive duration" in res.output and "Traceback" not in res.output


def test_decisions_follow_prints_new_entries(acted, redis_url, redis_client):
    store = PolicyStore(redis_client)
    redis_client.set(store.keys["epoch"], 3)  # as if a controller held the lease at epoch 3
    timer = threading.Timer(0.5, lambda: store.append_audit(
        {"kind": "alert.notify", "class": "facts", "rule": "heads-weak", "source": "webhook", "revision": 1},
        epoch=3))
    timer.start()
    res = invoke(redis_url, "decisions", "--since", "1s", "--follow", "--follow-for", "2", "--class", "facts")
    timer.join()
    assert res.exit_code == 0, res.output
    assert "alert.notify" in res.output and "epoch 3" in res.output and "rule heads-weak" in res.output


def test_decisions_show_analysis_values_against_thresholds_and_the_rollback(redis_client, redis_url):
    from specops.controller.analysis import run_analysis
    from specops.controller.sources import Reading

    store = PolicyStore(redis_client)
    machine.start_rollout(store, parse_policy(POLICY), POLICY)
    canary_text = POLICY.replace("version: ov1", "version: ov2").replace(
        "alerts:", "rollout:\n  steps: [{weight: 20, pause_s: 30}, {weight: 100}]\nalerts:")
    machine.start_rollout(store, parse_policy(canary_text), canary_text)
    slow = window(0.9, 4, rounds=500, draft_factor=20.0)  # drafting 20x dearer: slower than plain
    result = run_analysis(parse_policy(canary_text).analysis_rules(), {"code": Reading(slow)})
    assert result.outcome == "failed"
    machine.record_analysis(store, {"outcome": result.outcome, "message": result.message,
                                    "evaluations": result.evaluations})
    machine.fail(store, reason=f"analysis: {result.message}")
    res = invoke(redis_url, "decisions")
    assert res.exit_code == 0, res.output
    out = res.output
    analysis = out[out.index("rollout.analysis"):]
    assert "rev 2" in out[out.rindex("\n", 0, out.index("rollout.analysis")):out.index("rollout.analysis")]
    assert f"rule slower on code: {slow.speedup:.4g} < 1 -> violated" in analysis
    assert "rollout.degraded" in out and "why: analysis: slower on code" in out
    doc = json.loads(invoke(redis_url, "status", "--json").output)
    assert doc["phase"] == "degraded" and doc["revision"] == 2 and set(doc["classes"]) == {"code", "chat", "facts", "trees"}
