"""The Helm chart: `helm lint` and `helm template` pass, and what it ships matches the generators."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from specops.alerts import dashboard
from specops.alerts.render import RenderOptions, render
from specops.policies import load_policy
from tests.services import REQUIRE_SERVICES, require_binary

pytestmark = pytest.mark.services

CHART = Path(__file__).resolve().parents[2] / "charts" / "specops"


def _helm() -> str:
    """helm from $SPECOPS_HELM, else from PATH (require_binary semantics)."""
    explicit = os.environ.get("SPECOPS_HELM")
    if explicit:
        if Path(explicit).is_file() and os.access(explicit, os.X_OK):
            return explicit
        msg = f"SPECOPS_HELM={explicit} is not an executable file"
        if REQUIRE_SERVICES:
            pytest.fail(msg)
        pytest.skip(msg)
    return require_binary("helm")


def _template(*sets: str, check: bool = True) -> subprocess.CompletedProcess:
    argv = [_helm(), "template", "rel", str(CHART), "--namespace", "ml"]
    for s in sets:
        argv += ["--set", s]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def _docs(*sets: str) -> dict[tuple[str, str], dict]:
    docs = [d for d in yaml.safe_load_all(_template(*sets).stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_helm_lint_passes():
    for sets in ([], ["prometheusRule.enabled=true,serviceMonitor.enabled=true,inferenceExample.enabled=true,redis.url=redis://r:6379/0"]):
        argv = [_helm(), "lint", "--strict", str(CHART)] + [a for s in sets for a in ("--set", s)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


def test_default_install_objects():
    docs = _docs()
    assert set(docs) == {("Secret", "rel-specops"), ("ConfigMap", "rel-specops-policy"),
                         ("ConfigMap", "rel-specops-dashboard"), ("Service", "rel-specops"),
                         ("Deployment", "rel-specops-controller")}
    # the policy ConfigMap holds a valid policy (the chart's default)
    policy_text = docs[("ConfigMap", "rel-specops-policy")]["data"]["policy.yaml"]
    assert load_policy(policy_text).version == "chart-default-2"
    # the dashboard ConfigMap carries the sidecar label and the generated dashboard
    dash = docs[("ConfigMap", "rel-specops-dashboard")]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dash["data"]["specops.json"] == dashboard.dashboard_json().rstrip("\n")
    # the controller reads its token and Redis URL from the Secret, and mounts the policy
    deploy = docs[("Deployment", "rel-specops-controller")]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["SPECOPS_WEBHOOK_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "rel-specops", "key": "webhook-token"}
    assert "--policy=/etc/specops/policy.yaml" in container["args"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/etc/specops"]]["configMap"]["name"] == "rel-specops-policy"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert len(docs[("Secret", "rel-specops")]["stringData"]["webhook-token"]) == 40


def test_operator_objects_and_sidecar_are_values_gated():
    docs = _docs("prometheusRule.enabled=true", "serviceMonitor.enabled=true", "inferenceExample.enabled=true",
                 "redis.url=redis://r:6379/0", "webhook.token=tok")
    rule = docs[("PrometheusRule", "rel-specops")]
    expected = yaml.safe_load(render(load_policy(CHART / "files" / "policy.yaml"), "prometheus"))
    assert rule["spec"] == expected
    monitor = docs[("ServiceMonitor", "rel-specops")]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert docs[("Secret", "rel-specops")]["stringData"] == {"webhook-token": "tok", "redis-url": "redis://r:6379/0"}
    pod = docs[("Deployment", "rel-specops-inference-example")]["spec"]["template"]["spec"]
    names = [c["name"] for c in pod["containers"]]
    assert names == ["engine-spec", "engine-plain", "specops-sidecar"]
    sidecar = pod["containers"][-1]
    assert {m["name"] for m in sidecar["volumeMounts"]} <= {v["name"] for v in pod["volumes"]}


def test_existing_secrets_and_custom_policy(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text((CHART / "files" / "policy.yaml").read_text().replace("chart-default-2", "custom-7"))
    out = subprocess.run([_helm(), "template", "rel", str(CHART), "--set", "webhook.existingSecret=mine",
                          "--set", "redis.existingSecret=mine", "--set-file", f"policy={policy}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    assert ("Secret", "rel-specops") not in docs
    assert load_policy(docs[("ConfigMap", "rel-specops-policy")]["data"]["policy.yaml"]).version == "custom-7"
    env = {e["name"]: e for e in docs[("Deployment", "rel-specops-controller")]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPECOPS_REDIS"]["valueFrom"]["secretKeyRef"]["name"] == "mine"


def test_controller_runs_two_leader_elected_replicas_with_a_shared_redis(tmp_path):
    from specops.controller.cli import run_command

    docs = _docs("redis.url=redis://r:6379/0")
    dep = docs[("Deployment", "rel-specops-controller")]
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    # the standby stays off the leader's node when it can
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    pdb = docs[("PodDisruptionBudget", "rel-specops-controller")]["spec"]
    assert pdb["minAvailable"] == 1 and pdb["selector"] == dep["spec"]["selector"]
    # both replicas elect through the one Redis, with a lease the tick can keep (the CLI's own rule)
    policy = tmp_path / "policy.yaml"
    policy.write_text((CHART / "files" / "policy.yaml").read_text())
    container = pod["containers"][0]
    ctx = run_command.make_context("run", [a.replace("/etc/specops/policy.yaml", str(policy)) for a in container["args"]])
    assert ctx.params["lease_ttl_ms"] == 15000 and ctx.params["interval_s"] < ctx.params["lease_ttl_ms"] * 0.9 / 1000
    env = {e["name"]: e for e in container["env"]}
    assert env["SPECOPS_REDIS"]["valueFrom"]["secretKeyRef"]["key"] == "redis-url"  # the shared one, from the Secret
    assert _docs("redis.url=redis://r:6379/0", "controller.replicas=3")[("Deployment", "rel-specops-controller")][
        "spec"]["replicas"] == 3


def test_embedded_redis_runs_a_single_controller_replica():
    """Each pod's embedded Redis would hold its own lease: two replicas would both lead."""
    for sets in ((), ("controller.replicas=3",)):
        docs = _docs(*sets)
        assert docs[("Deployment", "rel-specops-controller")]["spec"]["replicas"] == 1
        assert ("PodDisruptionBudget", "rel-specops-controller") not in docs
        assert "affinity" not in docs[("Deployment", "rel-specops-controller")]["spec"]["template"]["spec"]


def test_a_lease_shorter_than_the_tick_is_refused():
    out = _template("redis.url=redis://r:6379/0", "controller.tickSeconds=14", check=False)
    assert out.returncode != 0 and "leaseTtlMs" in out.stderr
    _template("redis.url=redis://r:6379/0", "controller.tickSeconds=14", "controller.leaseTtlMs=20000")


def test_committed_rules_match_the_chart_policy():
    """files/prometheus-rules.yaml is `specops alerts render` of files/policy.yaml."""
    policy = load_policy(CHART / "files" / "policy.yaml")
    assert (CHART / "files" / "prometheus-rules.yaml").read_text() == render(policy, "prometheus", RenderOptions()), (
        "regenerate: specops alerts render -o charts/specops/files/prometheus-rules.yaml charts/specops/files/policy.yaml")


def test_chart_arguments_are_accepted_by_the_controller_cli(tmp_path):
    """The args the chart passes to `specops controller run` parse with the real click command."""
    from specops.controller.cli import run_command

    policy = tmp_path / "policy.yaml"
    policy.write_text((CHART / "files" / "policy.yaml").read_text())
    docs = _docs("inferenceExample.enabled=true", "redis.url=redis://r:6379/0", "prometheus.url=http://prom:9090")
    # (the inference pod's sidecar runs `specops sidecar`: tests/sidecar/test_chart.py)
    containers = [docs[("Deployment", "rel-specops-controller")]["spec"]["template"]["spec"]["containers"][0]]
    for container in containers:
        assert container["command"] == ["specops", "controller", "run"]
        args = [a.replace("/etc/specops/policy.yaml", str(policy)) for a in container["args"]]
        ctx = run_command.make_context("run", args)
        assert ctx.params["policy_file"] == str(policy)
        assert ctx.params["prometheus_url"] == "http://prom:9090"
        assert ctx.params["listen"].startswith("0.0.0.0:")


def test_sidecar_without_shared_redis_is_refused():
    out = _template("inferenceExample.enabled=true", check=False)
    assert out.returncode != 0 and "needs a shared Redis" in out.stderr
