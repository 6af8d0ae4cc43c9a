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
VLLM_SCHEDULE = json.loads((Path(__file__).parent / "fixtures" / "vllm_speculative_config.json").read_text())


def _vllm_schedule_problem(table, max_k=None):
    """Why ``table`` is not a valid vLLM per-batch-size schedule (the fixture's rules); None if it is."""
    if not isinstance(table, list) or not table:
        return "not a non-empty list"
    entries = []
    for entry in table:
        if not isinstance(entry, list) or len(entry) != 3 or not all(type(v) is int for v in entry):
            return f"entry {entry!r} is not 3 integers"
        start, end, k = entry
        if start <= 0 or end <= 0 or start > end:
            return f"entry {entry!r}: range must be positive with start <= end"
        if k < 0 or (max_k is not None and k > max_k):
            return f"entry {entry!r}: K out of range"
        entries.append(entry)
    entries.sort()
    previous_end = 0
    for start, end, _ in entries:
        if start <= previous_end:
            return f"range starting at {start} overlaps the previous one"
        previous_end = end
    if entries[0][0] != 1:
        return "first range does not start at 1"
    return None


def test_schedule_validator_agrees_with_vllm_examples():
    assert VLLM_SCHEDULE["declared_type"] == "list[tuple[int, int, int]] | None"
    for table in VLLM_SCHEDULE["valid"]:
        assert _vllm_schedule_problem(table) is None, table
    for table in VLLM_SCHEDULE["invalid"]:
        assert _vllm_schedule_problem(table) is not None, table


def _k_by_batch(table):
    return [next(k for start, end, k in table if start <= b <= end) for b in range(1, 4097)]


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
    table = cfg["num_speculative_tokens_per_batch_size"]
    assert table == [[1, 4, 6], [5, 4096, 0]]
    assert _vllm_schedule_problem(table, max_k=cfg["num_speculative_tokens"]) is None
    # with an SLO the bench's goodput decides: here speculation loses at 4 too
    slo = _report([("off", 1, 50, 1.0), ("fixed", 1, 90, 2.0), ("off", 4, 150, 3.0), ("fixed", 4, 160, 2.5)], slo=True)
    assert batch_table(slo, 3) == [[1, 1, 3], [2, 4096, 0]]


def test_a_noisy_loss_between_clear_gains_does_not_switch_speculation_off():
    # 1: +80%, 4: -3% (noise), 16: +20%: speculation stays on everywhere
    report = _report([("off", 1, 50, 1), ("fixed", 1, 90, 1), ("off", 4, 150, 1), ("fixed", 4, 145, 1),
                      ("off", 16, 400, 1), ("adaptive", 16, 480, 1)])
    assert batch_table(report, 6) == [[1, 4096, 6]]


def test_a_noisy_gain_after_clear_losses_does_not_switch_speculation_back_on():
    # 1: +50%, 4: -30%, 16: -20%, 64: +2% (noise): off from batch 2 on, never back on
    report = _report([("off", 1, 100, 1), ("fixed", 1, 150, 1), ("off", 4, 300, 1), ("fixed", 4, 210, 1),
                      ("off", 16, 500, 1), ("fixed", 16, 400, 1), ("off", 64, 900, 1), ("fixed", 64, 918, 1)])
    assert batch_table(report, 4) == [[1, 1, 4], [2, 4096, 0]]


def test_no_gain_anywhere_is_one_range_without_speculation():
    report = _report([("off", 1, 100, 1), ("fixed", 1, 100, 1), ("off", 8, 300, 1), ("fixed", 8, 200, 1)])
    assert batch_table(report, 4) == [[1, 4096, 0]]


@pytest.mark.parametrize("seed", range(40))
def test_derived_tables_are_valid_for_vllm_and_never_switch_back_on(seed):
    import random

    rng = random.Random(seed)
    rows = []
    for c in sorted(rng.sample([1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096], rng.randint(1, 8))):
        plain = rng.uniform(10, 1000)
        rows += [("off", c, plain, 1), (rng.choice(["fixed", "adaptive"]), c, plain * rng.uniform(0.5, 1.6), 1)]
    table = batch_table(_report(rows), 5)
    assert _vllm_schedule_problem(table, max_k=5) is None
    ks = _k_by_batch(table)
    assert set(ks) <= {0, 5}
    assert all(not (earlier == 0 and later > 0) for earlier, later in zip(ks, ks[1:])), table


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
    eagle = load_policy(DEFAULT.read_text().replace("method: draft", "method: eagle"))
    for engine in ("vllm", "sglang", "llamacpp"):  # specops' own EAGLE drafter is rendered for no engine
        with pytest.raises(EngineConfigError, match="eagle"):
            render(engine, eagle, method="eagle", model="m")


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


def test_cli_renders_the_measured_table_as_vllm_entries(tmp_path):
    measured = tmp_path / "bench.json"
    measured.write_text(json.dumps(_report([("off", 1, 50, 1), ("fixed", 1, 90, 1), ("off", 4, 150, 1),
                                            ("fixed", 4, 140, 1), ("off", 16, 400, 1), ("fixed", 16, 300, 1)])))
    out = subprocess.run([sys.executable, "-m", "specops.cli", "engine-config", "--engine", "vllm", "--policy",
                          str(DEFAULT), "--method", "draft", "--model", "d", "--measured", str(measured),
                          "--format", "json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(json.loads(out.stdout)[1])
    assert cfg["num_speculative_tokens_per_batch_size"] == [[1, 1, 6], [2, 4096, 0]]
    assert _vllm_schedule_problem(cfg["num_speculative_tokens_per_batch_size"], cfg["num_speculative_tokens"]) is None
