"""The chart's inference example: engine pools + the real ``specops sidecar``, Service on the sidecar."""

from __future__ import annotations

import subprocess

import yaml

from specops.policies import load_policy
from specops.sidecar.cli import sidecar_command
from tests.alerts.test_chart import CHART, _docs, _helm

SETS = ("inferenceExample.enabled=true", "redis.url=redis://r:6379/0")


def test_lint_strict_with_the_inference_example():
    out = subprocess.run([_helm(), "lint", "--strict", str(CHART), "--set", ",".join(SETS)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sidecar_container_args_parse_with_the_real_cli(tmp_path):
    docs = _docs(*SETS, "sidecar.args={--scrape-s=2}")
    pod = docs[("Deployment", "rel-specops-inference-example")]["spec"]["template"]
    spec = pod["spec"]
    side = spec["containers"][-1]
    assert side["command"] == ["specops", "sidecar"]
    policy = tmp_path / "policy.yaml"
    policy.write_text((CHART / "files" / "policy.yaml").read_text())
    args = [a.replace("/etc/specops/policy.yaml", str(policy)) for a in side["args"]]
    ctx = sidecar_command.make_context("sidecar", args)
    assert ctx.params["engine"] == "vllm" and ctx.params["listen"] == "0.0.0.0:9400" and ctx.params["scrape_s"] == 2.0
    assert ctx.params["records"] == "auto"  # one writer per request: the sidecar for vLLM, the engine for specops
    # every upstream points at an engine container's port in the same pod
    ports = {p["containerPort"] for c in spec["containers"][:-1] for p in c["ports"]}
    for value in ctx.params["upstreams"]:
        name, url = value.split("=", 1)
        assert url.startswith("http://127.0.0.1:") and int(url.rsplit(":", 1)[1]) in ports
    # the pool names are the ones the chart's policy routes to (default spec / plain)
    u = load_policy(policy).upstreams
    names = {v.split("=", 1)[0] for v in ctx.params["upstreams"]}
    assert names == ({u.spec, u.plain} if u else {"spec", "plain"})
    assert side["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "checksum/policy" in pod["metadata"]["annotations"]
    svc = docs[("Service", "rel-specops-inference-example")]["spec"]
    assert svc["ports"][0]["targetPort"] == "specops" and svc["selector"] == pod["metadata"]["labels"]
    assert docs[("Deployment", "rel-specops-controller")]["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "specops", "controller", "run"]


def test_single_engine_pool_values_render():
    out = subprocess.run([_helm(), "template", "rel", str(CHART), "--set", ",".join(SETS) + ",sidecar.engine=sglang",
                          "--set-json", 'sidecar.upstreams=[{"name":"spec","url":"http://127.0.0.1:30000"}]'],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    side = docs[("Deployment", "rel-specops-inference-example")]["spec"]["template"]["spec"]["containers"][-1]
    args = [a.replace("/etc/specops/policy.yaml", __file__) for a in side["args"]]
    ctx = sidecar_command.make_context("sidecar", args)
    assert ctx.params["engine"] == "sglang" and ctx.params["upstreams"] == ("spec=http://127.0.0.1:30000",)
