"""``specops bench sidecar --engine llamacpp``: its summary (gain over the better single pool) and its options."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specops.bench.serve import RequestResult
from specops.bench.sidecar_llamacpp import cell_stats, format_table, summarize
from specops.bench.sidecar_overhead import bench_sidecar_command


def _cell(tps, code=None, creative=None):
    return {"tokens_per_s": tps, "code_tokens_per_s": code, "creative_tokens_per_s": creative, "errors": 0}


def test_cell_stats_per_class_and_overall():
    results = [RequestResult(ok=True, e2e_s=1.0, output_tokens=40), RequestResult(ok=True, e2e_s=2.0, output_tokens=20),
               RequestResult(ok=False, error="x")]
    out = cell_stats(results, ["code", "creative", "code"], wall_s=2.0)
    assert (out["tokens"], out["errors"], out["tokens_per_s"]) == (60, 1, 30.0)
    assert (out["code_tokens_per_s"], out["creative_tokens_per_s"]) == (40.0, 10.0)


def test_gain_is_routed_over_the_better_single_pool():
    runs = [{"concurrency": 1, "routed": _cell(120), "all-spec": _cell(100), "all-plain": _cell(80),
             "sidecar_cpu": {"cpu_ms_per_request": 0.5, "cpu_ms_per_chunk": 0.02}},
            {"concurrency": 1, "routed": _cell(90), "all-spec": _cell(70), "all-plain": _cell(100),
             "sidecar_cpu": {"cpu_ms_per_request": 0.7, "cpu_ms_per_chunk": 0.03}}]
    (row,) = summarize(runs)
    assert row["gain_runs"] == [pytest.approx(1.2), pytest.approx(0.9)]
    # medians: routed 105, all-spec 85, all-plain 90
    assert row["gain"] == pytest.approx(105 / 90) and row["meets_goal"] is True
    assert row["sidecar_cpu_ms_per_request"] == pytest.approx(0.6)
    report = {"config": {"repeats": 2}, "results": [row], "llama_version": "version: 1 (x)",
              "pool_args": {"spec": ["--spec-type", "ngram-simple"], "plain": ["--spec-type", "none"]},
              "load_average": [1.0, 1.0, 1.0], "cpu_count": 2}
    table = format_table(report)
    assert "1.17x" in table and "routed" in table and "--spec-type none" in table


@pytest.mark.parametrize("extra", [["--base-url", "http://127.0.0.1:1"], ["--plain"]])
def test_llamacpp_refuses_options_of_the_overhead_bench(extra):
    out = CliRunner().invoke(bench_sidecar_command, ["--engine", "llamacpp", *extra])
    assert out.exit_code == 2 and "does not apply" in out.output, out.output
