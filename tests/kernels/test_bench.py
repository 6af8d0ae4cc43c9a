"""`specops bench kernels`: the CPU run of the baselines, byte accounting, goals and the table."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from specops.cli import main
from specops.kernels.bench import (
    FLEX_BACKENDS,
    SDPA_BACKENDS,
    SDPA_FORMS,
    KernelBenchConfig,
    KernelBenchReport,
    KernelBenchRow,
    _chain_and_branches_mask,
    attention_bytes,
    flex_call,
    format_table,
    run_kernel_bench,
    sdpa_candidates,
    wall_median_ms,
)
from specops.kernels.tree_attention import tree_attention_reference

# The baselines against the float32 reference: outputs are convex mixes of N(0, 1) values.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3}


def quick_timer(fn) -> float:
    return wall_median_ms(fn, warmup=0, min_reps=1, min_s=0.0)


def _inputs(dtype, nodes=8, prefix=40, heads_q=4, heads_kv=2, head_dim=16):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads_q, nodes, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, heads_kv, prefix + nodes, head_dim, generator=gen).to(dtype)
    v = torch.randn(1, heads_kv, prefix + nodes, head_dim, generator=gen).to(dtype)
    tree = _chain_and_branches_mask(nodes, "cpu")
    full = torch.cat([torch.ones(nodes, prefix, dtype=torch.bool), tree], 1)
    expected = tree_attention_reference(q.float(), k.float(), v.float(), tree, head_dim ** -0.5)
    return q, k, v, tree, full, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_sdpa_candidate_matches_the_reference_and_names_a_known_backend(dtype):
    q, k, v, tree, full, expected = _inputs(dtype)
    calls = sdpa_candidates(q, k, v, full)
    assert calls  # the CPU has math at least
    for key, call in calls.items():
        backend, form = key.split("/")
        assert backend in SDPA_BACKENDS and form in SDPA_FORMS
        assert (call().float() - expected).abs().max().item() < TOLERANCE[dtype], key
    # the expanded form runs under a fused CPU backend, not only the math one
    assert any(key.endswith("/expanded") and not key.startswith("math") for key in calls), sorted(calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flex_attention_over_the_tree_block_mask_matches_the_reference(dtype):
    q, k, v, tree, _, expected = _inputs(dtype, nodes=16, prefix=37)
    backend, call = flex_call(q, k, v, tree, 37, compile=False)
    assert backend == "eager"
    assert (call().float() - expected).abs().max().item() < TOLERANCE[dtype]


def test_the_bench_on_cpu_times_the_baselines_and_reports_their_backends():
    config = KernelBenchConfig(nodes=(3, 8), prefixes=(0, 40), heads_q=4, heads_kv=2, head_dim=16,
                               dtype="float16", copy_bytes=1 << 16, flex_compile=False)
    report = run_kernel_bench(config, device="cpu", timer=quick_timer)
    assert {r.impl for r in report.rows} == {"torch", "sdpa", "flex"} and "triton" in report.skipped
    assert len(report.rows) == 4 * 3
    for row in report.rows:
        assert row.max_abs_err < TOLERANCE[torch.float16], row
        assert row.ms > 0 and row.speedup_vs_baseline > 0
        base = min(report.row(row.nodes, row.prefix, i).ms for i in ("sdpa", "flex"))
        assert row.speedup_vs_baseline == pytest.approx(base / row.ms)
    for row in (r for r in report.rows if r.impl == "sdpa"):
        backend, form = row.backend.split("/")
        assert backend in SDPA_BACKENDS and form in SDPA_FORMS
        assert row.ms == min(row.candidates.values()) and row.backend in row.candidates
    assert all(r.backend in FLEX_BACKENDS for r in report.rows if r.impl == "flex")
    table = format_table(report)
    assert "triton not run: no CUDA device" in table and "backend" in table
    doc = report.to_json()
    assert {r["backend"] for r in doc["rows"] if r["impl"] == "sdpa"} <= {f"{b}/{f}" for b in SDPA_BACKENDS
                                                                          for f in SDPA_FORMS}
    assert "triton" in doc["skipped"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_without_cuda_times_the_baselines_on_the_cpu(tmp_path):
    out = tmp_path / "kernels.json"
    result = CliRunner().invoke(main, ["bench", "kernels", "--nodes", "4", "--prefix", "24", "--heads", "4",
                                       "--kv-heads", "2", "--head-dim", "16", "--dtype", "float32",
                                       "--no-flex-compile", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "triton not run" in result.output
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and {r["impl"] for r in doc["rows"]} == {"torch", "sdpa", "flex"}
    sdpa = next(r for r in doc["rows"] if r["impl"] == "sdpa")
    assert sdpa["backend"].split("/")[0] in SDPA_BACKENDS and sdpa["backend"] in sdpa["candidates"]
    assert next(r for r in doc["rows"] if r["impl"] == "flex")["backend"] == "eager"
    result = CliRunner().invoke(main, ["bench", "kernels", "--impl", "triton"])
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output


def test_cli_rejects_bad_grid():
    result = CliRunner().invoke(main, ["bench", "kernels", "--nodes", "300"])
    assert result.exit_code == 2 and "T must be in [1, 256]" in result.output
    result = CliRunner().invoke(main, ["bench", "kernels", "--heads", "30", "--kv-heads", "8"])
    assert result.exit_code == 2 and "multiple of heads_kv" in result.output


def test_attention_bytes_counts_q_k_v_o():
    # B=1, Hq=32, Hkv=8, T=64, L=16k, D=128, bf16
    q_or_o = 32 * 64 * 128 * 2
    k_or_v = 8 * (16384 + 64) * 128 * 2
    assert attention_bytes(1, 32, 8, 64, 16384, 128, 2) == 2 * q_or_o + 2 * k_or_v


def _row(impl, ms, base_ms, frac, backend=""):
    return KernelBenchRow(nodes=64, prefix=16384, impl=impl, ms=ms, gbps=frac * 4000, fraction_of_copy=frac,
                          speedup_vs_baseline=base_ms / ms, max_abs_err=1e-3, backend=backend)


def test_goals_and_table():
    report = KernelBenchReport(device="test-gpu", dtype="bfloat16", copy_gbps=4000.0, config=KernelBenchConfig())
    report.rows = [_row("triton", 0.020, 0.040, 0.85, "triton"), _row("sdpa", 0.040, 0.040, 0.42, "cudnn/expanded")]
    assert [met for _, met in report.goals()] == [True, True]
    table = format_table(report)
    assert "test-gpu" in table and "2.00x" in table and "85%" in table and "NOT met" not in table
    assert "cudnn/expanded" in table and "fastest baseline" in table
    report.rows = [_row("triton", 0.035, 0.040, 0.5), _row("sdpa", 0.040, 0.040, 0.42)]
    assert [met for _, met in report.goals()] == [False, False]
    assert format_table(report).count("NOT met") == 2
    doc = report.to_json()
    assert doc["rows"][0]["impl"] == "triton" and doc["goals"][0]["met"] is False


def test_config_validation():
    KernelBenchConfig().validate()
    with pytest.raises(ValueError, match="impls"):
        KernelBenchConfig(impls=("cublas",)).validate()
    with pytest.raises(ValueError, match="L must be"):
        KernelBenchConfig(prefixes=(-1,)).validate()


def test_an_sdpa_candidate_off_the_reference_is_no_baseline(monkeypatch):
    """A backend that returns the wrong attention (however fast) is left out of the sdpa row."""
    from specops.kernels import bench

    original = bench.sdpa_candidates

    def candidates(q, k, v, full_mask):
        right = original(q, k, v, full_mask)
        return {**right, "cudnn/expanded": lambda: torch.zeros_like(q)}

    monkeypatch.setattr(bench, "sdpa_candidates", candidates)
    times = iter(range(1000, 0, -1))  # every later call times faster: the wrong candidate would win
    config = KernelBenchConfig(nodes=(4,), prefixes=(24,), heads_q=4, heads_kv=2, head_dim=16, dtype="float32",
                               copy_bytes=1 << 12, impls=("sdpa",))
    report = run_kernel_bench(config, device="cpu", timer=lambda fn: float(next(times)))
    row = report.row(4, 24, "sdpa")
    assert row.backend != "cudnn/expanded" and "cudnn/expanded" not in row.candidates
    assert "off the reference" in report.skipped["sdpa cudnn/expanded"]
