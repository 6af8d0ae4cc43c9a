import subprocess

import pytest
import yaml
from click.testing import CliRunner

from specops.alerts.cli import render_command
from specops.alerts.render import RenderError, RenderOptions, alert_name, duration, render
from specops.policies import load_policy
from specops.telemetry import contract
from tests.alerts.policies import TEST_POLICY
from tests.services import require_binary


@pytest.fixture
def policy():
    return load_policy(TEST_POLICY)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_prometheus_rules_carry_for_labels_and_guard(policy):
    doc = yaml.safe_load(render(policy, "prometheus"))
    rules = doc["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == ["SpecopsSpeedupBelow1", "SpecopsCodeAcceptanceLow", "SpecopsHeadAccuracyLow"]
    speed, accept, heads = rules
    assert speed["for"] == "2m" and accept["for"] == "0s" and heads["for"] == "90500ms"
    assert speed["labels"] == {"severity": "critical", "rule": "speedup-below-1", "action": "fallback", "source": "specops"}
    assert contract.promql("speedup", "5m") in speed["expr"]
    assert speed["expr"].endswith("(sum by (class) (increase(specops_drafted_tokens_total[5m])) >= 100)")
    assert ") < 1 and on (class) (" in speed["expr"]
    assert 'specops_accepted_tokens_total{class=~"code|creative\\\\.v2"}[5m]' in accept["expr"]
    assert ") <= 0.5 and on (class)" in accept["expr"]
    assert "by (class, head)" in heads["expr"]


def test_window_option_and_durations(policy):
    doc = yaml.safe_load(render(policy, "prometheus", RenderOptions(window="30s", interval="5s")))
    assert doc["groups"][0]["interval"] == "5s"
    assert "[30s]" in doc["groups"][0]["rules"][0]["expr"] and "[5m]" not in doc["groups"][0]["rules"][0]["expr"]
    assert [duration(s) for s in (0, 1.5, 60, 3600, 90)] == ["0s", "1500ms", "1m", "1h", "90s"]
    with pytest.raises(RenderError, match="window"):
        RenderOptions(window="5 minutes")
    with pytest.raises(RenderError, match="unknown format"):
        render(policy, "nagios")


@pytest.mark.services
def test_rendered_rules_pass_promtool(policy, tmp_path):
    promtool = require_binary("promtool")
    for fmt in ("prometheus", "prometheus-operator"):
        doc = yaml.safe_load(render(policy, fmt, RenderOptions(namespace="ml")))
        if fmt == "prometheus-operator":
            assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["metadata"]["namespace"] == "ml"
            doc = doc["spec"]
        path = _write(tmp_path, f"{fmt}.yml", yaml.safe_dump(doc))
        out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "SUCCESS: 3 rules found" in out.stdout


@pytest.mark.services
def test_rendered_rules_fire_only_for_the_slow_class_with_enough_samples(policy, tmp_path):
    """promtool's rule unit tests: speed-up 0.5 with volume fires; speed-up 0.5 without volume and 1.5 do not."""
    promtool = require_binary("promtool")
    _write(tmp_path, "rules.yml", render(policy, "prometheus", RenderOptions(interval="1m")))
    series = []
    # per minute: (plain-time estimate s, decode s, drafted tokens)
    for cls, plain, wall, drafted in (("slow", 30, 60, 600), ("fast", 90, 60, 600), ("quiet", 30, 60, 1)):
        for name, per_min in ((contract.PLAIN_SECONDS_ESTIMATE.name, plain), (contract.DECODE_SECONDS.name, wall),
                              (contract.DRAFTED_TOKENS.name, drafted)):
            series.append({"series": f'{name}{{class="{cls}",method="draft"}}', "values": f"0+{per_min}x30"})
    labels = {"severity": "critical", "rule": "speedup-below-1", "action": "fallback", "source": "specops"}
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "SpecopsSpeedupBelow1", "exp_alerts": []},  # pending since 1m (for: 2m)
                {"eval_time": "10m", "alertname": "SpecopsSpeedupBelow1", "exp_alerts": [{
                    "exp_labels": {**labels, "class": "slow"},
                    "exp_annotations": {
                        "summary": "speedup < 1 for class slow",
                        "description": "specops policy 'alerts-test-1' rule 'speedup-below-1': speedup is 0.5 "
                                       "(< 1 for 2m, at least 100 drafted tokens). Action: fallback.",
                    },
                }]},
            ],
        }],
    }
    path = _write(tmp_path, "test.yml", yaml.safe_dump(tests))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_grafana_provisioning_shape(policy):
    doc = yaml.safe_load(render(policy, "grafana", RenderOptions(datasource_uid="prom-1", folder="ML")))
    assert doc["apiVersion"] == 1
    group = doc["groups"][0]
    assert group["folder"] == "ML" and group["orgId"] == 1
    rules = group["rules"]
    assert len({r["uid"] for r in rules}) == 3 and all(len(r["uid"]) <= 40 for r in rules)
    first = rules[0]
    assert first["condition"] == "C" and first["for"] == "2m"
    query, reduce, cond = first["data"]
    assert query["datasourceUid"] == "prom-1" and query["model"]["instant"] is True
    assert contract.promql("speedup", "5m") in query["model"]["expr"] and ">= 100" in query["model"]["expr"]
    assert reduce["model"]["type"] == "reduce" and reduce["model"]["expression"] == "A"
    assert cond["model"] == {"refId": "C", "type": "math", "expression": "$B < 1"}
    assert first["labels"]["action"] == "fallback" and first["labels"]["rule"] == "speedup-below-1"


def test_cli_renders_and_reports_policy_errors(tmp_path):
    good = _write(tmp_path, "p.yaml", TEST_POLICY)
    result = CliRunner().invoke(render_command, ["--format", "prometheus-operator", "--window", "1m", str(good)])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.output)["kind"] == "PrometheusRule"
    out = tmp_path / "rules.yml"
    result = CliRunner().invoke(render_command, ["-o", str(out), str(good)])
    assert result.exit_code == 0 and "SpecopsSpeedupBelow1" in out.read_text()

    bad = _write(tmp_path, "bad.yaml", TEST_POLICY.replace("threshold: 0.5", "threshold: 5"))
    result = CliRunner().invoke(render_command, [str(bad)])
    assert result.exit_code == 1
    assert "bad.yaml:" in result.output and "alerts[1].threshold" in result.output

    none = _write(tmp_path, "none.yaml", TEST_POLICY.split("alerts:")[0])
    result = CliRunner().invoke(render_command, [str(none)])
    assert result.exit_code == 1 and "no alert rules" in result.output


def test_alert_names_are_valid_metric_names(policy):
    for rule in policy.alerts:
        assert alert_name(rule).isidentifier()
