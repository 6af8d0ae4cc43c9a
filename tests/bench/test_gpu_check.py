"""`make gpu-check` keeps working on a CPU: its --dry-run runs every step at toy sizes."""

from __future__ import annotations

import json

import specops.bench.gpu_check as gpu_check
from specops.bench.gpu_check import main
from specops.bench.suites import BenchPrompt, write_prompts_file


def test_gpu_check_dry_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    prompts = tmp_path / "code.jsonl"  # what a machine without the stdlib tests is given
    write_prompts_file([BenchPrompt("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", "code"),
                        BenchPrompt("class Point:\n    def __init__(self, x, y):\n", "code")], prompts)
    assert main(["--dry-run", "--json", str(out), "--prompts", str(prompts)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["gpu"] is None
    steps = {r["step"]: r for r in report["results"]}
    assert set(steps) == {"cuda-tests", "kernels", "decode-bundled", "decode-1b"}
    assert steps["cuda-tests"]["status"] == steps["kernels"]["status"] == "skipped"
    random_target = steps["decode-1b"]["detail"]
    assert set(random_target["methods"]) == {"hf-greedy", "ar", "ngram", "auto"}
    assert all(row["exact"] for row in random_target["methods"].values())
    assert list(random_target["verify_relative"]) == list(random_target["forward_ms"]) == ["1", "2", "4", "8"]
    bundled = steps["decode-bundled"]["detail"]
    assert bundled["device"] == "cpu"
    assert all(r["exact_match"] for r in bundled["results"] if r["method"] != "hf-greedy")
    assert all(r["new_tokens"] == 2 * 8 for r in bundled["results"])  # the file's two prompts, 8 tokens each
    printed = capsys.readouterr().out
    assert "decode-1b" in printed and "decode-bundled on cpu:" in printed


def test_a_failing_step_keeps_the_others_results(tmp_path, monkeypatch, capsys):
    """The JSON is rewritten after every step: a step that raises is recorded as failed,
    the steps before and after it keep their results, and the exit status says so."""
    out = tmp_path / "gpu_check.json"
    seen = []

    def bundled(dry_run, device, prompts_file=None):
        seen.append(json.loads(out.read_text())["results"])  # the JSON as the step before it left it
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_check, "decode_bundled", bundled)
    monkeypatch.setattr(gpu_check, "decode_random", lambda dry_run, device: {"skipped": "not under test"})
    assert main(["--dry-run", "--json", str(out)]) == 1
    assert [r["step"] for r in seen[0]] == ["cuda-tests", "kernels"]
    steps = {r["step"]: r for r in json.loads(out.read_text())["results"]}
    assert steps["decode-bundled"]["status"] == "failed"
    assert steps["decode-bundled"]["detail"]["error"] == "RuntimeError: boom"
    assert steps["decode-1b"]["status"] == "skipped"
    assert "RuntimeError: boom" in capsys.readouterr().out


def test_every_cuda_test_path_exists():
    """The cuda-tests step names test files by path: a renamed file must be renamed there too."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    missing = [p for p in gpu_check.CUDA_TESTS if not (root / p).exists()]
    assert not missing, missing
