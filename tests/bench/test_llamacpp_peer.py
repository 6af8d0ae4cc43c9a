from __future__ import annotations

import json

import pytest

import specops.bench.llamacpp_peer as peer
from specops.assets import TARGET_DIR
from specops.bench.decode import BenchConfig, Models, encode_prompts, format_table, load_models, run_benchmark
from specops.bench.gguf_convert import ensure_gguf
from specops.bench.peers import HFMethod
from specops.bench.suites import BenchPrompt, builtin_suite
from tests.bench.peer_support import require_module
from tests.train.tiny_assets import tiny_llama, tiny_tokenizer

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def tiny_models():
    tok = tiny_tokenizer()
    return Models(target=tiny_llama(len(tok), layers=2, seed=0), draft=None, medusa=None, tokenizer=tok,
                  eos_token_id=None, max_context=256)


PROMPTS = [BenchPrompt("def add(a, b):\n    return", "code"), BenchPrompt("import os\nimport sys\n", "code")]


def test_peers_that_cannot_run_are_reported_not_raised(tiny_models, monkeypatch):
    monkeypatch.setattr(peer, "llama_cpp_version", lambda: None)  # as on a machine without the extra
    cfg = BenchConfig(methods=["hf-greedy", "ar", "llama-cpp-python", "llama-cpp-python-lookup"], max_new_tokens=6, repeats=1,
                      progress=False)
    report = run_benchmark(cfg, models=tiny_models, prompts=PROMPTS)
    assert [r["method"] for r in report["results"]] == ["hf-greedy", "ar"]
    assert [u["method"] for u in report["unavailable"]] == ["llama-cpp-python", "llama-cpp-python-lookup"]
    assert all("pip install" in u["reason"] and "peers" in u["reason"] for u in report["unavailable"])
    table = format_table(report)
    assert any(line.split()[0] == "llama-cpp-python-lookup" and "unavailable: llama-cpp-python is not installed" in line
               for line in table.splitlines())
    json.dumps(report)


def test_in_memory_target_and_unsupported_architecture_are_reasons(tmp_path, monkeypatch):
    monkeypatch.setattr(peer, "llama_cpp_version", lambda: "0.test")
    methods, unavailable = peer.build_llama_cpp_methods(["ar", "llama-cpp-python"], None, dtype="float32", threads=1,
                                                        n_ctx=64, eos_token_id=None)
    assert methods == [] and "target model's folder" in unavailable["llama-cpp-python"]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    methods, unavailable = peer.build_llama_cpp_methods(["llama-cpp-python-lookup"], tmp_path, dtype="float32", threads=1,
                                                        n_ctx=64, eos_token_id=None)
    assert methods == [] and unavailable["llama-cpp-python-lookup"].startswith("GGUF conversion failed")
    assert "MambaForCausalLM" in unavailable["llama-cpp-python-lookup"]


def test_converted_bundled_target_is_token_exact_against_transformers(tmp_path):
    """The GGUF conversion (weights, RoPE layout, tokenizer) checked end to end through llama.cpp:
    same tokenization of the bundled prompts, same greedy tokens on all of them."""
    llama_cpp = require_module("llama_cpp")
    models = load_models(BenchConfig(methods=["hf-greedy"]))
    path = ensure_gguf(TARGET_DIR, cache_dir=tmp_path)
    prompts = builtin_suite("code")[:10] + builtin_suite("prose")[:4]
    ids = encode_prompts(prompts, models.tokenizer, max_context=models.max_context, max_new_tokens=NEW_TOKENS)

    vocab_only = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for prompt, expected in zip(prompts, ids):
        assert vocab_only.tokenize(prompt.text.encode(), add_bos=False, special=False)[-len(expected):] == expected

    hf = HFMethod("hf-greedy", models.target, eos_token_id=models.eos_token_id)
    runs = {name: peer.LlamaCppMethod(name, path, threads=1, n_ctx=models.max_context,
                                      eos_token_id=models.eos_token_id) for name in peer.LLAMA_CPP_PYTHON_METHODS}
    for i, prompt_ids in enumerate(ids):
        want = hf.run(prompt_ids, max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0).tokens
        for name, method in runs.items():
            got = method.run(prompt_ids, max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0)
            assert got.tokens == want, (name, i)
            assert got.target_forwards <= len(got.tokens)
    lookup = runs["llama-cpp-python-lookup"]
    out = lookup.run(ids[0], max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0)
    assert out.drafted > 0 and 0 <= out.accepted <= out.drafted
    assert runs["llama-cpp-python"].run(ids[0], max_new_tokens=8, temperature=0.0, seed=0).target_forwards == 8


def test_bench_rows_for_llama_cpp():
    require_module("llama_cpp")
    cfg = BenchConfig(methods=["hf-greedy", "ar", "llama-cpp-python", "llama-cpp-python-lookup"], max_new_tokens=16, repeats=1,
                      limit=2, threads=1, progress=False)
    report = run_benchmark(cfg)
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["hf-greedy", "ar", "llama-cpp-python", "llama-cpp-python-lookup"] and report["unavailable"] == []
    for name in peer.LLAMA_CPP_PYTHON_METHODS:
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["exact_prompts"] == "2/2"
        assert rows[name]["new_tokens"] == 2 * 16
    assert rows["llama-cpp-python"]["acceptance_rate"] is None and rows["llama-cpp-python"]["mean_accepted_len"] == 1.0
    assert report["machine"]["llama_cpp_python"]
