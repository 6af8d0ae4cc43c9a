"""`make gpu-check` keeps working on a CPU: its --dry-run runs every step at toy sizes."""

from __future__ import annotations

import json

from specops.bench.gpu_check import main


def test_gpu_check_dry_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert main(["--dry-run", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    steps = {r["step"]: r for r in report["results"]}
    assert set(steps) == {"cuda-tests", "kernels", "decode-bundled", "decode-1b"}
    assert steps["cuda-tests"]["status"] == steps["kernels"]["status"] == "skipped"
    random_target = steps["decode-1b"]["detail"]
    assert all(row["exact"] for row in random_target["methods"].values())
    assert list(random_target["verify_relative"]) == ["1", "2", "4", "8"]
    bundled = steps["decode-bundled"]["detail"]["results"]
    assert all(r["exact_match"] for r in bundled if r["method"] != "hf-greedy")
    assert "decode-1b" in capsys.readouterr().out
