"""`python -m specops.bench.engine_bench`: the mix and chat suites, the `policy` method, the library comparison."""

from __future__ import annotations

import pytest

from specops.bench import engine_bench
from specops.engine.engine import Engine


@pytest.fixture(scope="module")
def bundled():
    from specops.decoder import Decoder

    return Decoder.from_pretrained("bundled")


def test_mix_requests_carry_the_mix_temperatures_and_each_class_initial_settings(bundled):
    from specops.bench.serve import ServeBenchConfig, build_prompts
    from specops.policies.loader import load_policy

    policy = load_policy(engine_bench.default_policy_path())
    mix = engine_bench.mix_requests(bundled, 24)
    texts = build_prompts(ServeBenchConfig(), 24)
    assert [t for _, t, _ in mix] == [t for _, t in texts]
    assert {t for _, t, _ in mix} == {0.0, 1.0}  # greedy code / prose, sampled hot prompts
    for (ids, temperature, spec), (text, _) in zip(mix, texts):
        assert ids == bundled.tokenizer.encode(text)
        rc = policy.classify(text, {}, len(ids), temperature=temperature)
        assert spec.method == rc.method
        if rc.method in ("draft", "ngram"):
            assert spec.gamma == rc.gamma.initial


def test_a_mix_run_decodes_every_request_to_its_length_with_either_method(bundled):
    mix = engine_bench.mix_requests(bundled, 6)
    ids = [i for i, _, _ in mix]
    for method in ("ar", "policy"):
        eng = Engine(bundled, max_batch=2, kv_cache_mb=16)
        seconds, tokens, _ = engine_bench.run(eng, method, ids, 2, 5, mix)
        assert tokens == 6 * 5 and seconds > 0


def test_policy_needs_mix(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["engine_bench", "--methods", "ar,policy", "--concurrency", "1"])
    with pytest.raises(SystemExit):
        engine_bench.main()
    assert "policy needs --mix" in capsys.readouterr().err


def test_forward_split_charges_prompts_per_request_and_decode_per_later_token():
    from specops.spec.stats import DecodeStats

    a, b = DecodeStats(method="ar"), DecodeStats(method="ar")
    a.verify_s, a.prefill_s, a.new_tokens = 0.050, 0.020, 11  # 10 later tokens, 3 ms each
    b.verify_s, b.prefill_s, b.new_tokens = 0.040, 0.010, 11
    line = engine_bench.forward_split([a, b])
    assert line == "forward 45.0 ms/request: prefill 15.0 ms (33%), decode 3.00 ms per later output token"
    assert engine_bench.forward_split([]) == "forward: no finished requests"


def test_a_run_splits_its_forward_time_between_prefill_and_decode(bundled):
    mix = engine_bench.mix_requests(bundled, 4)
    eng = Engine(bundled, max_batch=2, kv_cache_mb=16)
    engine_bench.RECORDS.clear()
    engine_bench.run(eng, "ar", [i for i, _, _ in mix], 2, 6, mix)
    records = list(engine_bench.RECORDS)
    assert len(records) == 4
    for r in records:  # every request prefilled its prompt and then decoded 5 more tokens
        assert 0 < r.prefill_s < r.verify_s and r.new_tokens == 6
    share = float(engine_bench.forward_split(records).split("(")[1].split("%")[0])
    assert 0 < share < 100


def test_the_policy_method_runs_the_policy_retargeted_to_the_targets_parts(bundled):
    import types

    from specops.policies.loader import load_policy

    full = engine_bench.policy_for(bundled)  # the bundled decoder has every part the default names
    assert [rc.method for rc in full.classes] == [rc.method for rc in load_policy(engine_bench.default_policy_path()).classes]
    alone = engine_bench.policy_for(types.SimpleNamespace(draft=None, medusa=None, eagle=None))
    assert {rc.method for rc in alone.classes} <= {"ngram", "off", "auto"}
    with_eagle = engine_bench.policy_for(types.SimpleNamespace(draft=None, medusa=None, eagle=object()))
    methods = {rc.name: rc.method for rc in with_eagle.classes}
    assert methods["sampled"] == "eagle" and methods["factual"] == "eagle" and methods["code"] == "ngram"


def test_paired_ratios_are_the_median_of_each_repeats_ratio():
    assert engine_bench.paired([110.0, 90.0, 105.0], [100.0, 100.0, 100.0]) == "paired 1.05x (0.90-1.10)"


@pytest.mark.parametrize("argv, says", [
    (["--model", "/nonexistent/model-folder", "--methods", "ar"], "cannot load --model"),
    (["--methods", "ar,eagle"], "has no part for method(s) eagle"),
])
def test_a_model_or_method_it_cannot_run_is_a_clear_error(monkeypatch, capsys, argv, says):
    monkeypatch.setattr("sys.argv", ["engine_bench", "--concurrency", "1", *argv])
    with pytest.raises(SystemExit):
        engine_bench.main()
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_chat_requests_are_the_chat_suite_in_the_models_template_and_auto_runs_them(bundled, monkeypatch):
    from specops.bench.chat_suite import chat_model_suite
    from tests.bench.test_chat_model_suites import TEMPLATE

    monkeypatch.setattr(bundled.tokenizer, "chat_template", TEMPLATE, raising=False)
    suite = chat_model_suite("mixed", bundled.tokenizer)
    reqs = engine_bench.chat_requests(bundled, len(suite) + 2)
    assert [ids for ids, _, _ in reqs[: len(suite)]] == [bundled.tokenizer.encode(p.text) for p in suite]
    assert reqs[len(suite)][0] == reqs[0][0]  # repeated in order past the suite's end
    assert {t for _, t, _ in reqs} == {p.temperature for p in suite} and len({t for _, t, _ in reqs}) == 2
    eng = Engine(bundled, max_batch=2, kv_cache_mb=16)
    _, tokens, _ = engine_bench.run(eng, "auto", [ids for ids, _, _ in reqs[:4]], 2, 5, reqs[:4])
    assert tokens == 4 * 5


def test_the_chat_suite_needs_a_chat_template_and_no_mix(monkeypatch, capsys):
    for argv, says in ((["--suite", "chat"], "needs a model whose tokenizer has a chat template"),
                       (["--suite", "chat", "--mix"], "takes no --suite")):
        monkeypatch.setattr("sys.argv", ["engine_bench", "--concurrency", "1", "--methods", "ar", *argv])
        with pytest.raises(SystemExit):
            engine_bench.main()
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err


def test_auto_budgets_of_several_engines_share_what_one_servers_default_may_take():
    from specops.engine.kv_budget import KV_MEMORY_FRACTION, KVBudget

    roomy = KVBudget(mb=100.0, want_mb=100.0, available_mb=10_000.0, explicit=False)
    assert engine_bench.shared_auto_budget(roomy, 5) == 100.0  # each gets a server's default
    tight = KVBudget(mb=5_000.0, want_mb=12_000.0, available_mb=10_000.0, explicit=False)
    assert engine_bench.shared_auto_budget(tight, 5) == pytest.approx(KV_MEMORY_FRACTION * 10_000.0 / 5)
    unknown = KVBudget(mb=300.0, want_mb=300.0, available_mb=None, explicit=False)
    assert engine_bench.shared_auto_budget(unknown, 3) == 300.0


def test_library_runs_decode_the_same_prompts_with_decoder_generate(bundled):
    ids = engine_bench.prompts(bundled, 2)
    for method in ("ar", "ngram"):
        seconds, tokens = engine_bench.run_library(bundled, method, ids, 5)
        assert tokens == 2 * 5 and seconds > 0


def test_a_library_comparison_prints_the_engine_against_decoder_generate(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["engine_bench", "--concurrency", "1", "--methods", "ar,ngram", "--library",
                                     "--repeats", "1", "--requests", "4", "--max-tokens", "4"])
    engine_bench.main()
    out = capsys.readouterr().out
    for method in ("ar", "ngram"):
        assert f"c=  1 {method:7s} library " in out and "engine / library paired" in out


def test_library_compares_on_the_code_suite_only(monkeypatch, capsys):
    for extra in (["--mix"], ["--suite", "chat"], ["--profile"]):
        monkeypatch.setattr("sys.argv", ["engine_bench", "--concurrency", "1", "--methods", "ar", "--library", *extra])
        with pytest.raises(SystemExit):
            engine_bench.main()
        err = capsys.readouterr().err
        assert "--library compares on the code suite" in err and "Traceback" not in err
