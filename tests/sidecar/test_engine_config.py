"""``specops engine-config``: vLLM / SGLang launch arguments from the policy (and measurements)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specops.policies import load_policy
from specops.sidecar.engine_config import EngineConfigError, batch_table, render

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "examples" / "policies" / "default.yaml"


def _report(rows, slo=False):
    return {"config": {"slo_ttft_s": 1.0 if slo else None}, "results": [
        {"mode": m, "concurrency": c, "errors": 0, "output_tokens_per_s": t, "goodput_rps": g} for m, c, t, g in rows]}


def test_vllm_speculative_config_and_measured_batch_table():
    policy = load_policy(DEFAULT)
    args = render("vllm", policy, method="draft", model="org/draft")
    assert args[0] == "--speculative-config"
    cfg = json.loads(args[1])
    # γ max over the draft classes (code 2..10, general 1..6) sizes the engine's buffers
    assert cfg == {"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 10}
    report = _report([("off", 1, 50, 1), ("fixed", 1, 90, 1), ("off", 4, 150, 1), ("fixed", 4, 160, 1),
                      ("off", 16, 400, 1), ("fixed", 16, 300, 1)])
    cfg = json.loads(render("vllm", policy, method="draft", model="d", measured=report)[1])
    assert cfg["num_speculative_tokens_per_batch_size"] == {"1-1": 6, "2-4": 6, "5-4096": 0}
    # with an SLO the bench's goodput decides: here speculation loses at 4 too
    slo = _report([("off", 1, 50, 1.0), ("fixed", 1, 90, 2.0), ("off", 4, 150, 3.0), ("fixed", 4, 160, 2.5)], slo=True)
    assert batch_table(slo, 3) == {"1-1": 3, "2-4096": 0}


def test_errors_are_one_readable_line():
    policy = load_policy(DEFAULT)
    with pytest.raises(EngineConfigError, match="choose one with --method"):
        render("vllm", policy)
    with pytest.raises(EngineConfigError, match="needs --model"):
        render("vllm", policy, method="draft")
    with pytest.raises(EngineConfigError, match="SGLang has no medusa"):
        render("sglang", policy, method="medusa", model="h")
    with pytest.raises(EngineConfigError, match="no concurrency with both"):
        batch_table(_report([("fixed", 1, 1, 1)]), 3)


def test_sglang_flags_and_cli():
    args = render("sglang", load_policy(DEFAULT), method="draft", model="org/draft")
    assert args == ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "6", "--speculative-eagle-topk",
                    "1", "--speculative-num-draft-tokens", "7", "--speculative-draft-model-path", "org/draft"]
    out = subprocess.run([sys.executable, "-m", "specops.cli", "engine-config", "--engine", "vllm", "--policy",
                          str(DEFAULT), "--method", "medusa", "--model", "heads", "--format", "json"],
                         capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    # medusa: heads 1..4 in the factual class
    assert json.loads(json.loads(out.stdout)[1]) == {"method": "medusa", "model": "heads", "num_speculative_tokens": 4}
    bad = subprocess.run([sys.executable, "-m", "specops.cli", "engine-config", "--engine", "vllm", "--policy",
                          str(DEFAULT)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "--method" in bad.stderr
