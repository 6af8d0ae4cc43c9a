"""The chart's inference example with ``inferenceExample.engine=llamacpp``: two llama-server pools + the sidecar."""

from __future__ import annotations

import subprocess

import yaml

from specops.policies import load_policy
from specops.sidecar.cli import sidecar_command
from specops.sidecar.engine_config import render
from tests.alerts.test_chart import CHART, _helm
from tests.sidecar.llamacpp_support import help_text, require_llama_binary
from tests.sidecar.test_llamacpp_engine_config import _documented_options

SETS = ("inferenceExample.enabled=true", "redis.url=redis://r:6379/0", "inferenceExample.engine=llamacpp")


def _render(*sets: str) -> subprocess.CompletedProcess:
    return subprocess.run([_helm(), "template", "rel", str(CHART), "--set", ",".join(sets)], capture_output=True,
                          text=True, timeout=120)


def _pod(*sets: str) -> dict:
    out = _render(*sets)
    assert out.returncode == 0, out.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    return docs[("Deployment", "rel-specops-inference-example")]["spec"]["template"]


def test_lint_strict_with_llamacpp_pools():
    out = subprocess.run([_helm(), "lint", "--strict", str(CHART), "--set", ",".join(SETS)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_llamacpp_pools_behind_the_sidecar(tmp_path):
    pod = _pod(*SETS)
    containers = pod["spec"]["containers"]
    engines, side = containers[:-1], containers[-1]
    assert [c["name"] for c in engines] == ["engine-spec", "engine-plain"]
    assert all(c["image"].startswith("ghcr.io/ggml-org/llama.cpp") for c in engines)
    policy = tmp_path / "policy.yaml"
    policy.write_text((CHART / "files" / "policy.yaml").read_text())
    args = [a.replace("/etc/specops/policy.yaml", str(policy)) for a in side["args"]]
    ctx = sidecar_command.make_context("sidecar", args)
    assert ctx.params["engine"] == "llamacpp" and ctx.params["records"] == "auto"
    ports = {c["name"][len("engine-"):]: c["ports"][0]["containerPort"] for c in engines}
    assert dict(u.split("=", 1) for u in ctx.params["upstreams"]) == {
        name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    for c in engines:
        a = c["args"]
        assert a[a.index("--port") + 1] == str(ports[c["name"][len("engine-"):]])
        assert a[a.index("--model") + 1] == "/models/model.gguf"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["volumeMounts"][0] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert {"name": "models", "emptyDir": {}} in pod["spec"]["volumes"]
    # the values' pool flags are what `specops engine-config --engine llamacpp` renders for the chart's policy
    chart_policy = load_policy(policy)
    spec_args = engines[0]["args"][8:]
    plain_args = engines[1]["args"][8:]
    assert spec_args == render("llamacpp", chart_policy, method="draft", model="/models/draft.gguf", threads=4,
                               parallel=4)
    assert plain_args == render("llamacpp", chart_policy, pool="plain", threads=4, parallel=4)


def test_vllm_stays_the_default_and_other_engines_are_refused():
    pod = _pod("inferenceExample.enabled=true", "redis.url=redis://r:6379/0")
    assert pod["spec"]["containers"][0]["image"].startswith("vllm/")
    assert "--engine=vllm" in pod["spec"]["containers"][-1]["args"]
    assert not any(v["name"] == "models" for v in pod["spec"]["volumes"])
    bad = _render("inferenceExample.enabled=true", "redis.url=redis://r:6379/0", "inferenceExample.engine=tgi")
    assert bad.returncode != 0 and "inferenceExample.engine must be vllm or llamacpp" in bad.stderr


def test_chart_llamacpp_args_exist_in_the_built_llama_server():
    binary = require_llama_binary("llama-server")
    options = _documented_options(help_text(binary))
    for c in _pod(*SETS)["spec"]["containers"][:-1]:
        for a in c["args"]:
            if a.startswith("--"):
                assert a in options and "removed" not in options[a], (c["name"], a)
