"""method="auto" in the engine: a loaded method per request from live results; output stays exact."""

from __future__ import annotations

import random

import pytest

from specops.engine.auto_method import MethodChooser
from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings
from tests.serving.test_engine import full_speculation, qwen2, run_staggered  # noqa: F401  (fixture)


def test_chooser_tries_every_method_then_prefers_the_best_and_keeps_exploring():
    ch = MethodChooser(min_samples=2)
    methods = ("ngram", "draft", "medusa")
    tried = [ch.choose(methods) for _ in range(6)]
    assert set(tried) == set(methods)  # untried methods first, round robin
    per_forward = {"ngram": 1.2, "draft": 1.6, "medusa": 2.4}
    for m, value in per_forward.items():
        for _ in range(2):
            ch.observe(m, new_tokens=1 + int(value * 40), target_forwards=41)
    picks = [ch.choose(methods) for _ in range(1000)]
    share = picks.count("medusa") / len(picks)
    assert 0.85 < share < 0.98  # the best, except the probes of the others
    # the others are still tried, the worse one the rarer, and none waits past the rule's longest wait
    assert picks.count("draft") > picks.count("ngram") > 0
    for m in ("ngram", "draft"):
        at = [i for i, p in enumerate(picks) if p == m]
        assert max(b - a for a, b in zip(at, at[1:])) <= ch.rule.max_wait
    # The score follows the traffic: medusa stops paying, the others take over.
    for _ in range(20):
        ch.observe("medusa", new_tokens=41, target_forwards=41)
    assert max(methods, key=lambda m: ch.scores[m]) == "draft"


def test_chooser_rejects_nothing_to_choose_and_ignores_empty_requests():
    ch = MethodChooser()
    with pytest.raises(ValueError, match="at least one"):
        ch.choose(())
    ch.observe("ngram", new_tokens=1, target_forwards=1)  # prefill only: no decode forward to score
    assert ch.samples == {}


def test_auto_requests_run_loaded_methods_and_equal_ar(qwen2):  # noqa: F811
    rng = random.Random(11)
    prompts = [[rng.randrange(96) for _ in range(rng.randrange(4, 20))] for _ in range(9)]
    eng = full_speculation(Engine(qwen2, max_batch=4, kv_cache_mb=4, eos_token_id=None))
    want = {f"a{i}": qwen2.generate(p, method="ar", max_new_tokens=24, eos_token_id=None).tokens
            for i, p in enumerate(prompts)}
    reqs = [(f"a{i}", p, SamplingParams(max_tokens=24), SpecSettings(method="auto", gamma=4, tree_size=8))
            for i, p in enumerate(prompts)]
    got, records, _ = run_staggered(eng, reqs)
    assert got == want
    ran = {r.method for r in records.values()}
    assert ran <= {"ngram", "draft", "medusa"} and len(ran) == 3  # every loaded method was tried
    assert sum(eng.auto[(None, False)].samples.values()) == len(prompts)


def test_auto_estimates_are_kept_per_class_and_per_greedy_or_sampled(qwen2):  # noqa: F811
    """Each (auto_key, sampled) pair learns on its own: code's results never steer prose."""
    eng = full_speculation(Engine(qwen2, max_batch=4, kv_cache_mb=4, eos_token_id=None))
    reqs = []
    for i in range(6):
        key = "code" if i % 2 else "prose"
        params = SamplingParams(max_tokens=12, temperature=0.8 if i % 3 == 0 else 0.0, seed=i)
        reqs.append((f"k{i}", [3, 5, 7, 9 + i], params, SpecSettings(method="auto", gamma=3, tree_size=8,
                                                                    auto_key=key)))
    run_staggered(eng, reqs)
    want = {("code", False): 2, ("code", True): 1, ("prose", False): 2, ("prose", True): 1}
    assert {k: sum(c.samples.values()) for k, c in eng.auto.items()} == want
