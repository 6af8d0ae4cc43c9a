"""``specops engine-config --engine llamacpp``: llama-server flags per pool, in the built binary's option names."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specops.policies import load_policy
from specops.sidecar.engine_config import LLAMACPP_OPTIONS, EngineConfigError, render
from tests.sidecar.llamacpp_support import help_text, require_llama_binary

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "examples" / "policies" / "default.yaml"
CODE = ROOT / "examples" / "policies" / "code-assistant.yaml"


def _report(rows):
    return {"config": {}, "results": [{"mode": m, "concurrency": c, "errors": 0, "output_tokens_per_s": t}
                                      for m, c, t in rows]}


def test_llamacpp_spec_pool_flags_per_method():
    policy = load_policy(DEFAULT)
    assert render("llamacpp", policy, method="draft", model="/m/draft.gguf", threads=2, parallel=4) == [
        "--metrics", "--threads", "2", "--parallel", "4", "--spec-type", "draft-simple",
        "--spec-draft-model", "/m/draft.gguf", "--spec-draft-n-max", "6"]
    # ngram γ: the code class's initial 6 is the largest initial γ of the ngram classes here
    policy_ngram = policy.model_copy(update={"classes": [c.model_copy(update={"method": "ngram"})
                                                         for c in policy.classes if c.method == "draft"]})
    assert render("llamacpp", policy_ngram) == ["--metrics", "--spec-type", "ngram-simple",
                                                "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "6"]


def test_llamacpp_plain_pool_and_client_mistakes():
    policy = load_policy(DEFAULT)
    assert render("llamacpp", policy, pool="plain", parallel=2) == ["--metrics", "--parallel", "2",
                                                                     "--spec-type", "none"]
    with pytest.raises(EngineConfigError, match="llama.cpp has no medusa"):
        render("llamacpp", policy, method="medusa")
    with pytest.raises(EngineConfigError, match="needs --model"):
        render("llamacpp", policy, method="draft")
    with pytest.raises(EngineConfigError, match="llama.cpp options"):
        render("vllm", policy, method="draft", model="d", parallel=2)
    with pytest.raises(EngineConfigError, match="positive integer"):
        render("llamacpp", policy, method="draft", model="d", threads=0)


def test_llamacpp_measured_k_at_the_pool_parallel_slots():
    policy = load_policy(DEFAULT)
    measured = _report([("off", 1, 50), ("fixed", 1, 90), ("off", 4, 150), ("fixed", 4, 140)])
    one = render("llamacpp", policy, method="draft", model="d", measured=measured, parallel=1)
    assert one[-2:] == ["--spec-draft-n-max", "6"]
    with pytest.raises(EngineConfigError, match="speculation losing at 4 parallel"):
        render("llamacpp", policy, method="draft", model="d", measured=measured, parallel=4)
    with pytest.raises(EngineConfigError, match="needs --parallel"):
        render("llamacpp", policy, method="draft", model="d", measured=measured)


def test_llamacpp_cli_json_and_error_without_traceback():
    out = subprocess.run([sys.executable, "-m", "specops.cli", "engine-config", "--engine", "llamacpp", "--policy",
                          str(DEFAULT), "--method", "draft", "--model", "d.gguf", "--parallel", "2", "--format",
                          "json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[:3] == ["--metrics", "--parallel", "2"]
    bad = subprocess.run([sys.executable, "-m", "specops.cli", "engine-config", "--engine", "llamacpp", "--policy",
                          str(DEFAULT), "--method", "medusa"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "no medusa" in bad.stderr


def _documented_options(help_out: str) -> dict[str, str]:
    """Option name -> its help line(s), from llama-server's --help (``-a, --long-name VALUE  text``)."""
    options: dict[str, str] = {}
    current: list[str] = []
    for line in help_out.splitlines():
        m = re.match(r"^((?:-{1,2}[\w-]+(?:,\s*)?)+)", line)
        if m:
            current = re.findall(r"-{1,2}[\w-]+", m.group(1))
            for name in current:
                options[name] = line
        elif current and line.startswith(" "):
            for name in current:
                options[name] += "\n" + line
    return options


def test_rendered_options_exist_in_the_built_llama_server():
    binary = require_llama_binary("llama-server")
    options = _documented_options(help_text(binary))
    assert "--spec-type" in options, "llama-server --help did not parse"
    for name in LLAMACPP_OPTIONS:
        assert name in options, f"llama-server has no {name}"
        assert "removed" not in options[name], options[name]
    for spec_type in ("draft-simple", "ngram-simple", "none"):
        assert spec_type in options["--spec-type"]
    policy = load_policy(DEFAULT)
    for args in (render("llamacpp", policy, method="draft", model="d", threads=1, parallel=1),
                 render("llamacpp", policy, pool="plain")):
        assert all(a in options for a in args if a.startswith("--"))
