"""`specops bench kernels`: the CLI without CUDA, byte accounting, goals and the table."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from specops.cli import main
from specops.kernels.bench import (
    KernelBenchConfig,
    KernelBenchReport,
    KernelBenchRow,
    attention_bytes,
    format_table,
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_without_cuda_says_so_and_exits_zero():
    result = CliRunner().invoke(main, ["bench", "kernels", "--json", "unused.json"])
    assert result.exit_code == 0, result.output
    assert "needs a CUDA GPU" in result.output


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


def _row(impl, ms, sdpa_ms, frac):
    return KernelBenchRow(nodes=64, prefix=16384, impl=impl, ms=ms, gbps=frac * 4000, fraction_of_copy=frac,
                          speedup_vs_sdpa=sdpa_ms / ms, max_abs_err=1e-3)


def test_goals_and_table():
    report = KernelBenchReport(device="test-gpu", dtype="bfloat16", copy_gbps=4000.0, config=KernelBenchConfig())
    report.rows = [_row("triton", 0.020, 0.040, 0.85), _row("sdpa", 0.040, 0.040, 0.42)]
    assert [met for _, met in report.goals()] == [True, True]
    table = format_table(report)
    assert "test-gpu" in table and "2.00x" in table and "85%" in table and "NOT met" not in table
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
