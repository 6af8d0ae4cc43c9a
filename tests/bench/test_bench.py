from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specops.bench.decode import BenchConfig, BenchError, Models, format_table, run_benchmark, summarize
from specops.bench.peers import MethodRun
from specops.bench.suites import BenchPrompt, SuiteError, load_prompts_file
from tests.train.tiny_assets import tiny_llama, tiny_tokenizer

KEYS = {"method", "tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_len", "exact_match"}
GREEDY_METHODS = ["hf-greedy", "hf-assisted", "hf-lookup", "ar", "draft", "ngram"]


@pytest.fixture(scope="module")
def tiny_models():
    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), layers=2, seed=0)
    draft = tiny_llama(len(tok), layers=1, seed=1)
    return Models(target=target, draft=draft, medusa=None, tokenizer=tok, eos_token_id=None, max_context=256)


PROMPTS = [
    BenchPrompt("def add(a, b):\n    return", "code"),
    BenchPrompt("class Point:\n    def __init__(self, x, y):\n", "code"),
    BenchPrompt("for i in range(10):\n    print(i * i)\nfor i in range(10):\n", "code"),
    BenchPrompt('def greet(name):\n    """Say hello', "prose"),
]


def test_harness_reports_every_key_and_greedy_methods_are_exact(tiny_models):
    cfg = BenchConfig(methods=GREEDY_METHODS, max_new_tokens=12, repeats=2, progress=False)
    report = run_benchmark(cfg, models=tiny_models, prompts=PROMPTS)
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == GREEDY_METHODS
    for row in rows.values():
        assert KEYS <= set(row)
        assert row["tokens_per_s"] > 0 and len(row["tokens_per_s_runs"]) == 2
        assert row["exact_match"] is True, (row["method"], row["exact_prompts"])
        assert row["new_tokens"] == 2 * len(PROMPTS) * 12  # no EOS: every method emits max_new_tokens
    assert rows["hf-greedy"]["speedup"] == 1.0 and rows["hf-greedy"]["mean_accepted_len"] == 1.0
    assert rows["hf-greedy"]["acceptance_rate"] is None and rows["ar"]["acceptance_rate"] is None
    for name in ("draft", "ngram", "hf-assisted"):
        assert 0.0 <= rows[name]["acceptance_rate"] <= 1.0
    assert len(rows["draft"]["acceptance_by_pos"]) == cfg.gamma
    assert report["divergences"] == []
    assert set(rows["draft"]["by_kind"]) == {"code", "prose"}
    json.dumps(report)  # JSON-ready
    table = format_table(report)
    assert all(name in table for name in GREEDY_METHODS)
    assert rows["hf-greedy"]["prefill_share"] is None  # transformers' generate does not expose it
    assert 0.0 < rows["ar"]["prefill_share"] < 1.0 and 0.0 < rows["draft"]["prefill_share"] < 1.0
    assert f"ar's prompt passes: {100 * rows['ar']['prefill_share']:.0f}% of its time" in table


def test_the_prefill_share_and_the_bound_it_puts_on_speed_ups():
    """ar spending 20% of its time on prompts: decoding the rest 2x / 3x faster reads
    1 / (0.2 + 0.8 / 2) = 1.67x and 1 / (0.2 + 0.8 / 3) = 2.14x ar."""
    prompts = [BenchPrompt("a"), BenchPrompt("b")]
    ar = [[MethodRun([1, 2], 1.0, 2, prefill_s=0.1), MethodRun([3, 4], 1.0, 2, prefill_s=0.3)]]
    hf = [[MethodRun([1, 2], 2.0, 2), MethodRun([3, 4], 2.0, 2)]]
    rows = {r.method: r for r in summarize({"hf-greedy": hf, "ar": ar}, prompts)}
    assert rows["ar"].prefill_share == pytest.approx(0.2) and rows["hf-greedy"].prefill_share is None
    report = {"results": [dataclasses.asdict(r) for r in rows.values()]}
    assert "ar's prompt passes: 20% of its time" in format_table(report)
    assert "2x / 3x as fast reads 1.67 / 2.14x ar" in format_table(report)
    report["results"] = [r for r in report["results"] if r["method"] != "ar"]
    assert "prompt passes" not in format_table(report)


def test_the_multiply_add_floor_under_a_verify_forward(tiny_models):
    """The floor `bench decode` prints beside c(T): T positions need T x the multiply-adds of
    every linear layer (the LM head included), at the C kernel's rate on weights in cache."""
    from specops.bench.decode import multiply_add_floor
    from specops.kernels import cpu_linear

    floor = multiply_add_floor(tiny_models.target, 8)
    if not cpu_linear.available():  # no compiler: nothing to measure the rate with
        assert floor is None
        return
    linears = [m for m in tiny_models.target.modules() if isinstance(m, torch.nn.Linear)]
    assert any(m is tiny_models.target.get_output_embeddings() for m in linears)
    assert floor["macs_per_position"] == sum(m.in_features * m.out_features for m in linears)
    assert floor["rate_per_s"] > 1e6 and floor["rows"] == 8
    assert floor["floor_s"] == pytest.approx(8 * floor["macs_per_position"] / floor["rate_per_s"])
    report = {"results": [], "costs": {"target_token_s": 1e-3, "verify_relative": {"1": 1.0, "8": 2.0},
                                       "multiply_add": {**floor, "rate_per_s": 2e10, "macs_per_position": 5e6,
                                                        "floor_s": 2e-3, "floor_relative": 2.0, "threads": 2}}}
    assert ("the target's matrices at T=8 need 40M multiply-adds: at the C kernel's rate on weights in cache "
            "(20.0 G/s, 2 threads) at least 2.00 ms, so c(8)/c(1) >= 2.00 before attention") in format_table(report)


def test_sampling_prompts_are_left_out_of_exactness(tiny_models):
    prompts = [BenchPrompt("def add(a, b):\n", "code"), BenchPrompt("import os\n", "hot", temperature=1.0)]
    cfg = BenchConfig(methods=["hf-greedy", "draft"], max_new_tokens=8, repeats=1, progress=False)
    report = run_benchmark(cfg, models=tiny_models, prompts=prompts)
    for row in report["results"]:
        assert row["exact_prompts"] == "1/1"


def test_greedy_sweep_checks_the_sampled_kinds_too(tiny_models):
    """`--greedy`: every prompt decodes greedily, so every output is checked for exactness."""
    prompts = [BenchPrompt("def add(a, b):\n", "code"), BenchPrompt("import os\n", "hot", temperature=1.0)]
    cfg = BenchConfig(methods=["hf-greedy", "draft", "ngram"], max_new_tokens=8, repeats=1, greedy=True, progress=False)
    report = run_benchmark(cfg, models=tiny_models, prompts=prompts)
    assert report["config"]["greedy"] is True
    for row in report["results"]:
        assert row["exact_prompts"] == "2/2"


def test_summary_flags_a_mismatch_and_computes_speedup():
    prompts = [BenchPrompt("a"), BenchPrompt("b")]
    ref = [[MethodRun([1, 2, 3], 1.0, 3), MethodRun([4, 5], 1.0, 2)]]
    fast = [[MethodRun([1, 2, 3], 0.5, 1, drafted=4, accepted=2, accepted_per_pos=[1, 1], drafted_per_pos=[2, 2]),
             MethodRun([4, 6], 0.5, 1, drafted=2, accepted=1, accepted_per_pos=[1], drafted_per_pos=[1, 1])]]
    rows = {r.method: r for r in summarize({"hf-greedy": ref, "draft": fast}, prompts)}
    assert rows["hf-greedy"].speedup == 1.0 and rows["hf-greedy"].exact_match is True
    assert rows["draft"].speedup == pytest.approx(2.0)
    assert rows["draft"].exact_match is False and rows["draft"].exact_prompts == "1/2"
    assert rows["draft"].acceptance_rate == pytest.approx(3 / 6)
    assert rows["draft"].mean_accepted_len == pytest.approx(5 / 2)
    assert rows["draft"].acceptance_by_pos == pytest.approx([2 / 3, 1 / 3], abs=1e-4)


def test_eagle_tree_runs_beside_the_chain_and_both_are_exact(tiny_models):
    from specops.models.eagle_model import EagleDrafter

    models = dataclasses.replace(tiny_models, eagle=EagleDrafter.for_target(tiny_models.target, seed=0))
    cfg = BenchConfig(methods=["hf-greedy", "eagle", "eagle-tree"], eagle_tree=(3, 2, 6), max_new_tokens=10,
                      repeats=1, progress=False)
    report = run_benchmark(cfg, models=models, prompts=PROMPTS)
    rows = {r["method"]: r for r in report["results"]}
    assert rows["eagle"]["exact_match"] is True and rows["eagle-tree"]["exact_match"] is True
    assert len(rows["eagle"]["acceptance_by_pos"]) == cfg.gamma
    assert 1 <= len(rows["eagle-tree"]["acceptance_by_pos"]) <= 3  # the tree's depth, not γ
    with pytest.raises(BenchError, match="topk must be"):
        BenchConfig(methods=["hf-greedy", "eagle-tree"], eagle_tree=(3, 0, 6)).validate()


def test_bad_config_is_rejected():
    with pytest.raises(BenchError, match="unknown method"):
        BenchConfig(methods=["hf-greedy", "warp"]).validate()
    with pytest.raises(BenchError, match="suite"):
        BenchConfig(suite="poetry").validate()
    with pytest.raises(BenchError, match="repeats"):
        BenchConfig(repeats=0).validate()
    with pytest.raises(BenchError, match="dtype"):
        BenchConfig(dtype="float8").validate()


def test_bad_device_is_rejected(monkeypatch):
    BenchConfig(device="cpu").validate()
    for bad in ("gpu0", "meta", "cuda:x"):
        with pytest.raises(BenchError, match="device must be cpu or cuda"):
            BenchConfig(device=bad).validate()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BenchError, match="sees no CUDA device"):
        BenchConfig(device="cuda").validate()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(BenchError, match="has 1 CUDA device"):
        BenchConfig(device="cuda:1").validate()
    with pytest.raises(BenchError, match="llama.cpp peers run on the CPU"):
        BenchConfig(device="cuda", methods=["hf-greedy", "llama.cpp"]).validate()
    BenchConfig(device="cuda:0", methods=["hf-greedy", "ar"]).validate()


def test_a_suite_round_trips_through_a_prompts_file_and_a_missing_stdlib_says_so(tmp_path, monkeypatch, capsys):
    """`python -m specops.bench.suites` writes a suite as the JSONL `--prompts` reads back, for a
    machine whose Python ships without the stdlib tests (a GPU image had one such file)."""
    import specops.train.data as data
    from specops.bench.suites import builtin_suite, main

    out = tmp_path / "mixed.jsonl"
    assert main(["--suite", "mixed", "--out", str(out)]) == 0
    assert load_prompts_file(out) == builtin_suite("mixed")
    assert {p.kind for p in load_prompts_file(out)} == {"code", "prose", "hot"}
    files = list(data.heldout_files())[:1]
    monkeypatch.setattr(data, "heldout_files", lambda root=None: tuple(files))
    for suite in ("code", "mixed"):
        with pytest.raises(SuiteError, match=r"only \d+ prompts found.*libpython3.X-testsuite.*--prompts prompts.jsonl"):
            builtin_suite(suite)
    monkeypatch.setattr(data, "heldout_files", lambda root=None: ())
    with pytest.raises(SuiteError, match="no held-out stdlib test files found.*--prompts"):
        builtin_suite("prose")
    with pytest.raises(SystemExit):
        main(["--suite", "code", "--out", str(tmp_path / "x.jsonl")])
    assert "error: no held-out" in capsys.readouterr().err
    with pytest.raises(SuiteError, match="unknown suite"):
        builtin_suite("poetry")


def test_prompts_file_formats(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "def f():", "temperature": 0.7, "kind": "code"}\n\n{"prompt": "Once upon"}\n')
    prompts = load_prompts_file(jsonl)
    assert prompts == [BenchPrompt("def f():", "code", 0.7), BenchPrompt("Once upon", "custom", 0.0)]
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert [p.text for p in load_prompts_file(txt)] == ["first prompt", "second prompt"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(SuiteError, match="bad.jsonl:1"):
        load_prompts_file(bad)
    with pytest.raises(SuiteError, match="not found"):
        load_prompts_file(tmp_path / "missing.txt")


def test_plot_writes_a_png(tmp_path):
    from specops.bench.plot import plot_report

    report = {"config": {"suite": "code"}, "prompts": 2, "results": [
        {"method": "hf-greedy", "tokens_per_s": 100.0, "speedup": 1.0, "acceptance_by_pos": []},
        {"method": "draft", "tokens_per_s": 180.0, "speedup": 1.8, "acceptance_by_pos": [0.9, 0.7, 0.5]},
    ]}
    path = plot_report(report, tmp_path / "out" / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no results"):
        plot_report({"results": []}, tmp_path / "empty.png")


def test_the_bundled_draft_drafts_over_its_shipped_vocabulary_in_the_benchmark():
    """`load_models` reads the draft folder's ``draft_vocab.json`` as `Decoder.from_pretrained`
    does, so `bench decode` measures the drafting decoding runs with; a custom draft without
    one drafts over the whole vocabulary."""
    import json

    from specops.assets import DRAFT_DIR
    from specops.bench.decode import build_methods, load_models

    cfg = BenchConfig(methods=["ar", "draft"], progress=False)
    models = load_models(cfg)
    shipped = json.loads((DRAFT_DIR / "draft_vocab.json").read_text())["tokens"]
    assert models.draft_vocab == shipped
    methods, _ = build_methods(cfg, models)
    decoder = next(m.decoder for m in methods if m.name == "draft")
    assert decoder.draft._draft_head[2].tolist() == shipped
    custom = Models(target=models.target, draft=models.draft, medusa=None, tokenizer=models.tokenizer,
                    eos_token_id=None, max_context=256)
    decoder = next(m.decoder for m in build_methods(cfg, custom)[0] if m.name == "draft")
    assert decoder.draft._draft_head is None


def test_the_ar_chain_reference_emits_ar_tokens_and_gets_its_own_column(tiny_models):
    """``ar-chain`` runs ar's forwards CHAIN_TOKENS per C call: the same tokens (an EOS inside a
    chain cuts it there), its own "vs ar-chain" ratio for every row, and ``ar`` on sampled prompts."""
    from specops.bench.decode import build_methods
    from specops.bench.peers import CHAIN_TOKENS, ChainedAR
    from specops.kernels import cpu_linear

    assert cpu_linear.available(), cpu_linear.unavailable_reason()  # CI builds the kernels: never a skip
    cfg = BenchConfig(methods=["hf-greedy", "ar", "ar-chain"], max_new_tokens=CHAIN_TOKENS + 9, repeats=1,
                      progress=False)
    report = run_benchmark(cfg, models=tiny_models, prompts=PROMPTS)
    rows = {r["method"]: r for r in report["results"]}
    assert rows["ar-chain"]["exact_match"] is True and rows["ar-chain"]["speedup_vs_ar_chain"] == 1.0
    assert rows["ar"]["speedup_vs_ar_chain"] == pytest.approx(rows["ar"]["tokens_per_s"]
                                                              / rows["ar-chain"]["tokens_per_s"], rel=1e-2)
    assert "vs ar-chain" in format_table(report)
    methods, _ = build_methods(cfg, tiny_models)
    chain = next(m for m in methods if isinstance(m, ChainedAR))
    plain = next(m for m in methods if m.name == "ar")
    ids = tiny_models.tokenizer.encode(PROMPTS[2].text)
    want = plain.run(ids, max_new_tokens=CHAIN_TOKENS + 9, temperature=0.0, seed=0).tokens
    eos = want[CHAIN_TOKENS + 3]  # an EOS in the second chain: the output stops at its first occurrence
    chain.eos_token_id = plain.eos_token_id = eos
    cut = plain.run(ids, max_new_tokens=CHAIN_TOKENS + 9, temperature=0.0, seed=0)
    got = chain.run(ids, max_new_tokens=CHAIN_TOKENS + 9, temperature=0.0, seed=0)
    assert got.tokens == cut.tokens and got.tokens[-1] == eos
    sampled = chain.run(ids, max_new_tokens=8, temperature=1.0, seed=3)
    assert sampled.tokens == plain.run(ids, max_new_tokens=8, temperature=1.0, seed=3).tokens
    assert "FastLlamaRunner" in ChainedAR.unavailable_reason(object())


def test_auto_takes_an_eagle_drafter_when_one_is_at_hand(tmp_path, monkeypatch):
    """`bench decode --methods auto`: the drafter given with --eagle, or the one cached for a
    registered --model, joins auto's options; with none, auto runs without it (no error)."""
    from specops.bench import decode
    from specops.models import eagle_io
    from specops.models import resolve

    assert decode.eagle_at_hand(BenchConfig(methods=["auto"], eagle=str(tmp_path)))
    assert not decode.eagle_at_hand(BenchConfig(methods=["auto"]))  # the bundled models: no drafter
    monkeypatch.setattr(resolve, "is_registered", lambda ref: ref == "some-model")
    monkeypatch.setattr(eagle_io, "default_dir", lambda ref: tmp_path / "eagle" / ref)
    cfg = BenchConfig(methods=["auto"], model="some-model")
    assert not decode.eagle_at_hand(cfg)  # registered, nothing cached
    monkeypatch.setattr(eagle_io, "is_drafter_dir", lambda path: path == tmp_path / "eagle" / "some-model")
    assert decode.eagle_at_hand(cfg)
