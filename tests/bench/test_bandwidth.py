"""The memory-bandwidth ceiling `specops bench decode` prints: bandwidth / weight bytes per token,
and ar's speed as a share of it."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from specops.bench.bandwidth import (bandwidth_ceiling, buffer_bytes, format_bandwidth, last_level_cache_bytes,
                                     read_bandwidth, streamed_weight_bytes)
from specops.bench.decode import format_table
from tests.train.tiny_assets import tiny_llama


def test_the_read_benchmark_sums_a_filled_buffer_and_restores_the_thread_count():
    before = torch.get_num_threads()
    out = read_bandwidth(nbytes=8 << 20, threads=1, repeats=3)
    assert torch.get_num_threads() == before
    assert out["buffer_bytes"] == 8 << 20 and out["threads"] == 1 and out["repeats"] == 3
    assert out["device"] == "cpu" and out["best_s"] > 0
    assert out["bytes_per_s"] == pytest.approx((8 << 20) / out["best_s"])
    with pytest.raises(ValueError):
        read_bandwidth(nbytes=8 << 20, repeats=0)


def test_the_buffer_is_much_larger_than_the_last_level_cache(tmp_path, monkeypatch):
    for index, (level, size) in enumerate([(1, "32K"), (2, "1024K"), (3, "64M")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 64 << 20
    assert last_level_cache_bytes(tmp_path / "missing") is None
    from specops.bench import bandwidth

    monkeypatch.setattr(bandwidth, "last_level_cache_bytes", lambda: 64 << 20)
    assert buffer_bytes() == 32 * (64 << 20)  # 2 GiB: 32 x the cache beats the 1 GiB floor
    monkeypatch.setattr(bandwidth, "last_level_cache_bytes", lambda: None)
    assert buffer_bytes() == 1 << 30


def test_weight_bytes_count_a_tied_lm_head_once_and_one_row_of_an_untied_table():
    tied = tiny_llama(64, layers=2)
    params = sum(p.numel() for p in tied.parameters())
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert streamed_weight_bytes(tied) == 4 * params
    assert streamed_weight_bytes(tied.to(torch.bfloat16)) == 2 * params  # the run's dtype
    from transformers import LlamaForCausalLM

    config = tied.config
    config.tie_word_embeddings = False
    untied = LlamaForCausalLM(config)
    vocab, hidden = untied.get_input_embeddings().weight.shape
    assert untied.get_output_embeddings().weight is not untied.get_input_embeddings().weight
    assert streamed_weight_bytes(untied) == 4 * (sum(p.numel() for p in untied.parameters()) - (vocab - 1) * hidden)


def test_the_ceiling_and_ar_share_use_the_decode_only_figure_when_there_is_one():
    measured = {"bytes_per_s": 20e9, "threads": 2, "device": "cpu", "buffer_bytes": 1 << 30, "repeats": 5}
    rows = [{"method": "hf-greedy", "tokens_per_s": 5.0, "decode_tokens_per_s": None},
            {"method": "ar", "tokens_per_s": 30.0, "decode_tokens_per_s": 34.0}]
    b = bandwidth_ceiling(measured, 538_000_000, rows)
    assert b["ceiling_tokens_per_s"] == pytest.approx(20e9 / 538e6, abs=1e-3)
    assert b["ar_measure"] == "decode" and b["ar_tokens_per_s"] == 34.0
    assert b["ar_fraction_of_ceiling"] == pytest.approx(34.0 / (20e9 / 538e6), abs=1e-4)
    assert format_bandwidth(b) == ("memory bandwidth 20.0 GB/s (read, 2 threads); weights 538.0 MB/token "
                                   "→ ceiling 37.2 tok/s; ar decode 34.0 tok/s = 91% of it")
    rows[1]["decode_tokens_per_s"] = None  # no decode-only figure: end-to-end, labelled so
    b = bandwidth_ceiling(measured, 538_000_000, rows)
    assert b["ar_measure"] == "end-to-end" and b["ar_tokens_per_s"] == 30.0
    assert format_bandwidth(b).endswith("; ar end-to-end 30.0 tok/s = 81% of it")
    b = bandwidth_ceiling(measured, 538_000_000, rows[:1])  # no ar row
    assert b["ar_tokens_per_s"] is None and format_bandwidth(b).endswith("ceiling 37.2 tok/s")
    report = {"results": [], "bandwidth": b}
    assert format_bandwidth(b) in format_table(report).splitlines()
    with pytest.raises(ValueError):
        bandwidth_ceiling(measured, 0, rows)


def test_bench_decode_prints_the_line_and_writes_the_bandwidth_key(tmp_path):
    from specops.bench.cli import bench_decode_command

    path = tmp_path / "report.json"
    result = CliRunner().invoke(bench_decode_command, ["--methods", "ar", "--limit", "1", "--max-new-tokens", "4",
                                                       "--repeats", "1", "--quiet", "--json", str(path)])
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    b = report["bandwidth"]
    assert b["bytes_per_s"] > 0 and b["threads"] == 2 and b["buffer_bytes"] >= 1 << 30
    assert b["ar_measure"] == "decode"  # ar exposes its prompt pass
    ar = next(r for r in report["results"] if r["method"] == "ar")
    assert b["ar_tokens_per_s"] == ar["decode_tokens_per_s"]
    assert b["ceiling_tokens_per_s"] == pytest.approx(b["bytes_per_s"] / b["weight_bytes_per_token"], rel=1e-3)
    assert format_bandwidth(b) in result.output.splitlines()
