"""llama.cpp's own llama-server as a peer of `specops bench decode`: reported unavailable with
the reason where it cannot run; where `make peers` built it, token-exact against our plain
decoding on the bundled target (f32 GGUF of the same weights), timed by llama.cpp's own
``timings``, and ``llama.cpp-spec`` tuned to an exact configuration."""

from __future__ import annotations

import pytest

import specops.bench.llamacpp_build as build
from specops.assets import TARGET_DIR
from specops.bench import llamacpp_server_peer as server_peer
from specops.bench.decode import BenchConfig, format_table, run_benchmark
from specops.bench.gguf_convert import source_gguf
from tests.bench.peer_support import require_module
from tests.sidecar.llamacpp_support import require_llama_binary


def test_server_methods_that_cannot_run_are_reasons(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "find_binary", lambda name="llama-server", version=None: None)
    methods, unavailable = server_peer.build_server_methods(["ar", "llama.cpp", "llama.cpp-spec"], TARGET_DIR,
                                                            dtype="float32", threads=1, n_ctx=256, eos_token_id=None)
    assert methods == [] and set(unavailable) == {"llama.cpp", "llama.cpp-spec"}
    assert "make peers" in unavailable["llama.cpp"]
    monkeypatch.setattr(build, "find_binary", lambda name="llama-server", version=None: "/bin/true")
    methods, unavailable = server_peer.build_server_methods(["llama.cpp-q4"], TARGET_DIR, dtype="float32",
                                                            threads=1, n_ctx=256, eos_token_id=None)
    assert methods == [] and "quantized GGUF" in unavailable["llama.cpp-q4"]  # the bundled model has none
    assert source_gguf(TARGET_DIR) is None


def test_llama_server_rows_are_exact_and_timed_by_llama_cpp():
    require_llama_binary("llama-server")
    require_module("gguf")
    cfg = BenchConfig(methods=["hf-greedy", "ar", "llama.cpp", "llama.cpp-spec"], suite="code", max_new_tokens=24,
                      repeats=1, limit=3, threads=1, progress=False)
    report = run_benchmark(cfg)
    rows = {r["method"]: r for r in report["results"]}
    assert report["unavailable"] == []
    for name in ("llama.cpp", "llama.cpp-spec"):
        assert rows[name]["exact_match"] is True, name  # the same weights, greedy: the same tokens
        assert 0 < rows[name]["prefill_share"] < 1 and rows[name]["decode_tokens_per_s"] > rows[name]["tokens_per_s"]
    assert rows["llama.cpp"]["acceptance_rate"] is None and rows["llama.cpp"]["mean_accepted_len"] == 1.0
    trials = report["peer_tuning"]["llama.cpp-spec"]
    assert len(trials) == len(server_peer.SPEC_CANDIDATES) and any(t["exact"] for t in trials)
    kept = report["peer_configs"]["llama.cpp-spec"]
    best = max((t for t in trials if t["exact"]), key=lambda t: t["tokens_per_s"])
    assert best["args"] in kept
    assert report["machine"]["llama_server"]
    assert "llama.cpp-spec: llama-server" in format_table(report)
