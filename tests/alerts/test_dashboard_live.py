"""The generated dashboard and the rendered alert rules against a real Prometheus with real data.

Prometheus (the Debian binary; skipped without it unless SPECOPS_REQUIRE_SERVICES=1)
scrapes a real ``specops serve`` process (bundled models, a real redis-server holding
the policy) that concurrent HTTP clients send completions to, and ``specops controller
run`` as a process; after some traffic every panel query and every alert rule's value must return data,
every alert condition must parse, and Prometheus must evaluate every rule without
error. Then ``specops dashboard check`` and ``snapshot`` run against the same server.
"""

from __future__ import annotations

import struct
import time

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from specops.alerts import dashboard  # noqa: E402
from specops.alerts.prometheus_api import PrometheusClient, fill_variables  # noqa: E402
from specops.alerts.snapshot import check_queries  # noqa: E402
from specops.cli import main  # noqa: E402
from tests.alerts.live_stack import POLICY, RULE_WINDOW, LiveStack  # noqa: E402

RATE_WINDOW = "15s"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = LiveStack(tmp_path_factory.mktemp("live"))
    try:
        s.start()
        # ~20 s of HTTP traffic: several scrapes and controller ticks with every class busy
        served = s.serve_for(20)
        assert served >= 20, served
        client = PrometheusClient(s.prometheus_url)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until the scrapes carry the controller's knob series
            if client.query("specops_controller_knob") and client.query("specops_medusa_head_predictions_total"):
                break
            time.sleep(1)
        s.serve_for(4)
        yield s
    finally:
        s.stop()


def test_every_dashboard_panel_returns_data(stack):
    client = PrometheusClient(stack.prometheus_url)
    empty = []
    for panel in dashboard.PANELS:
        series = client.query(fill_variables(dashboard.panel_expr(panel), RATE_WINDOW))
        if not series:
            empty.append(panel.title)
    assert not empty, f"panels without data: {empty}"
    # the class variable's query lists the policy's busy classes
    classes = {s.labels["class"] for s in client.query(dashboard.contract.REQUESTS.name)}
    assert classes == {"code", "facts", "chat", "general"}
    # per-class state agrees between the controller and the runtime
    knob = {(s.labels["class"], s.labels["knob"]): s.values[0]
            for s in client.query(dashboard.panel_expr(dashboard.Panel("k", "controller_knob", "short"), "1m", ""))}
    assert knob[("facts", "medusa_heads")] == 3 and ("code", "gamma") in knob
    fallen = client.query(fill_variables(dashboard.panel_expr(
        dashboard.Panel("f", "controller_fallbacks_active", "short")), RATE_WINDOW))
    assert {s.labels["class"] for s in fallen} >= {"code", "facts", "chat"}


def test_every_alert_rule_parses_returns_data_and_evaluates(stack):
    from specops.policies import load_policy

    policy = load_policy(POLICY)
    # fresh traffic: the rules read 15 s windows, and on a slow host the panel test's queries can
    # outlast the fixture's last burst (heads-weak then found fewer than its 5 facts drafts once)
    stack.serve_for(4)
    time.sleep(2)  # two more 1 s scrapes
    report = check_queries(PrometheusClient(stack.prometheus_url), rate_window=RATE_WINDOW, policy=policy,
                           window=RULE_WINDOW)
    assert not report.failed, "\n".join(report.lines())
    values = [c for c in report.checks if c.source.endswith("(value)")]
    assert len(values) == len(policy.alerts) and all(c.series >= 1 for c in values)
    # Prometheus itself loaded the rendered rules and evaluated each without error
    import requests

    groups = requests.get(f"{stack.prometheus_url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert len(rules) == len(policy.alerts)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(r.get("lastEvaluation", "").startswith("0001") for r in rules.values()):
        time.sleep(1)
        groups = requests.get(f"{stack.prometheus_url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert all(r["health"] == "ok" for r in rules.values()), {n: r.get("lastError") for n, r in rules.items()}


def test_dashboard_check_and_snapshot_commands(stack, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["dashboard", "check", "--prometheus", stack.prometheus_url, "--rate-window", "15s"])
    assert res.exit_code == 0, res.output
    assert res.output.count("ok   panel:") == len(dashboard.PANELS)
    out = tmp_path / "dash.png"
    res = runner.invoke(main, ["dashboard", "snapshot", "--prometheus", stack.prometheus_url, "--out", str(out),
                               "--range", "60", "--rate-window", "15s"])
    assert res.exit_code == 0, res.output
    n = len(dashboard.MAIN_PANELS)
    assert f"{n} of {n} panels with data" in res.output
    head = out.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width == 1400 and height > 600  # 14 in: the legends sit beside the panels


def test_commands_fail_cleanly_without_prometheus(tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["dashboard", "snapshot", "--prometheus", "http://127.0.0.1:1", "--out",
                               str(tmp_path / "x.png")])
    assert res.exit_code == 1 and "cannot reach Prometheus" in res.output and "Traceback" not in res.output
    res = runner.invoke(main, ["dashboard", "check", "--prometheus", "ftp://x"])
    assert res.exit_code == 2 and "http://" in res.output
    res = runner.invoke(main, ["dashboard", "snapshot", "--prometheus", "http://x", "--out", "y.png",
                               "--rate-window", "soon"])
    assert res.exit_code == 2 and "duration" in res.output
