import json
from pathlib import Path

from specops.alerts import dashboard
from specops.telemetry import controller_series as controller_metrics
from specops.telemetry import contract

COMMITTED = Path(__file__).resolve().parents[2] / "charts" / "specops" / "dashboards" / "specops.json"


def test_committed_dashboard_equals_the_generated_one():
    assert COMMITTED.read_text() == dashboard.dashboard_json(), (
        "charts/specops/dashboards/specops.json is stale: run "
        "`python -m specops.alerts.dashboard charts/specops/dashboards/specops.json`")


def test_every_panel_queries_a_contract_series():
    model = json.loads(dashboard.dashboard_json())
    exprs = [p["targets"][0]["expr"] for p in model["panels"]]
    expected = [contract.promql(p.series, dashboard.WINDOW, dashboard.MATCH) if p.series in contract.PROMQL
                else controller_metrics.promql(p.series, dashboard.WINDOW, dashboard.MATCH) for p in dashboard.PANELS]
    assert exprs == expected
    assert {p.series for p in dashboard.PANELS} >= set(controller_metrics.PROMQL)  # every controller series shown
    assert set(dashboard.MAIN_PANELS) <= {p.title for p in dashboard.PANELS}
    for needed in ("speedup", "acceptance_rate", "head_accuracy", "tokens_per_s", "p50_token_latency_s",
                   "p99_token_latency_s", "fallback_rate"):
        assert contract.promql(needed, dashboard.WINDOW, dashboard.MATCH) in exprs, needed
    assert all('class=~"$class"' in e for e in exprs)
    ids = [p["id"] for p in model["panels"]]
    assert len(set(ids)) == len(ids)
    positions = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in model["panels"]}
    assert len(positions) == len(ids)  # no two panels on top of each other
    assert {v["name"] for v in model["templating"]["list"]} == {"datasource", "class"}


def test_main_writes_the_file(tmp_path):
    out = tmp_path / "d.json"
    assert dashboard.main([str(out)]) == 0
    assert out.read_text() == dashboard.dashboard_json()
    assert dashboard.main(["a", "b"]) == 2


def test_snapshot_helpers_without_a_server():
    from specops.alerts.prometheus_api import PrometheusClient, fill_variables
    from specops.alerts.snapshot import QueryCheck, legend

    assert legend("{{class}} head {{head}}", {"class": "facts", "head": "2"}) == "facts head 2"
    assert legend("{{class}}", {}) == "value"
    expr = dashboard.panel_expr(dashboard.PANELS[0])
    filled = fill_variables(expr, "30s", "code|chat")
    assert "$" not in filled and '[30s]' in filled and 'class=~"code|chat"' in filled
    assert QueryCheck("rule: x (condition)", "e", 0, need_data=False).ok  # a silent alert is fine
    assert not QueryCheck("panel: y", "e", 0).ok and not QueryCheck("panel: y", "e", -1, "boom").ok
    import pytest

    with pytest.raises(ValueError, match="http"):
        PrometheusClient("localhost:9090")
