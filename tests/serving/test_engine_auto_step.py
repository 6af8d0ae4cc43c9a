"""``auto`` in the engine chooses before every step between prompt lookup and the chain drafter
its admission picked (`specops.engine.auto_method.StepChoice`), by the library's rule; greedy
output stays the target's own."""

from __future__ import annotations

import pytest

from specops.engine.auto_method import Profile, StepChoice, rate
from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings
from specops.spec.chooser import ProbeRule
from specops.spec.stats import DecodeStats
from tests.serving.test_engine import full_speculation, qwen2  # noqa: F401  (fixture)
from tests.serving.test_engine_eagle import _run, bundled, dec  # noqa: F401  (fixtures)


def test_rate_takes_the_best_draft_length():
    # 1 + 0.9 + 0.5 tokens in 3 s beats 1.9 in 2 s? 2.4/3 = 0.8 < 0.95: two drafts are best
    assert rate([0.9, 0.5], lambda k: 1.0 + k * 0.5) == pytest.approx(1.9 / 1.5)
    assert rate([0.9, 0.5], lambda k: 1.0) == pytest.approx(2.4)  # free drafts: all of them
    assert rate([], lambda k: 1.0) == 0.0


class _Seq:
    def __init__(self) -> None:
        self.spec = SpecSettings(method="eagle", gamma=4)
        self.stats = DecodeStats(method="eagle")
        self.alpha, self.acc_hits, self.acc_trials, self.accept_scale, self.prior_key = 0.7, 3.0, 4.0, 1.0, ("k", "eagle")


def test_each_option_keeps_its_own_acceptance_state_and_the_better_rate_runs():
    seq = _Seq()
    fresh = {"ngram:16+": 0.9, "ngram:1": 0.3}
    choice = StepChoice(seq, "eagle", lambda tier: Profile(fresh[tier], 0.0, 0.0, 1.0, ("k", tier)),
                        ProbeRule(every=4, budget=0.01, max_wait=10))
    choice.switch(seq, "ngram:16+")  # a long match's tier: its own estimate
    assert (seq.spec.method, seq.alpha, seq.acc_hits, seq.prior_key) == ("ngram", 0.9, 0.0, ("k", "ngram:16+"))
    seq.acc_hits, seq.alpha = 5.0, 0.95  # that tier's own record
    choice.switch(seq, "ngram:1")
    assert (seq.spec.method, seq.alpha, seq.prior_key) == ("ngram", 0.3, ("k", "ngram:1"))
    choice.switch(seq, "eagle")
    assert (seq.spec.method, seq.alpha, seq.acc_hits, seq.prior_key) == ("eagle", 0.7, 3.0, ("k", "eagle"))
    choice.switch(seq, "ngram:16+")
    assert (seq.alpha, seq.acc_hits) == (0.95, 5.0) and choice.tier == "ngram:16+"
    picks = [choice.choose({"ngram:16+": 2.0, "eagle": 1.0}) for _ in range(40)]
    assert 30 <= picks.count("ngram:16+") < 40  # the better one, and the other tried now and then
    at = [i for i, p in enumerate(picks) if p == "eagle"]
    assert max(b - a for a, b in zip([-1] + at, at + [40])) <= 10
    assert seq.stats.auto_steps == {"ngram": picks.count("ngram:16+"), "eagle": picks.count("eagle")}
    assert choice.choose({"eagle": 1.0}) == "eagle"  # lookup found no match: the drafter


def _lean(eng: Engine, lookup: float, drafter: float, method: str = "eagle") -> None:
    """Prime the engine's acceptance estimates: lookup drafts accepted at ``lookup``, the drafter's at ``drafter``."""
    for _ in range(60):
        for tier in ("ngram:16+", "ngram:8-15", "ngram:3-7", "ngram:2", "ngram:1", "ngram:store", "ngram"):
            eng.priors.observe_alpha((None, tier, False), round(4 * lookup), 4)
        eng.priors.observe_alpha((None, method, False), round(4 * drafter), 4)
    ch = eng._chooser(None, False)  # admission takes the drafter
    ch.samples, ch.scores = {"ngram": 9, method: 9}, {"ngram": 0.0, method: 9.0}


def _count_proposals(eng: Engine) -> dict[str, int]:
    """Sequences each method's proposer drafted for, counted as the engine calls them."""
    counts: dict[str, int] = {}
    for method, proposer in eng.proposers.items():
        def propose(seqs, sizes, plans, _inner=proposer.propose, _m=method):
            counts[_m] = counts.get(_m, 0) + len(seqs)
            return _inner(seqs, sizes, plans)
        proposer.propose = propose
    return counts


def test_an_auto_request_on_eagle_runs_lookup_where_it_matches_and_the_drafter_elsewhere(bundled, dec):
    eng = full_speculation(Engine(dec, max_batch=4, kv_cache_mb=8, eos_token_id=None))
    _lean(eng, lookup=1.0, drafter=0.5)
    proposed = _count_proposals(eng)
    before = dict(eng.priors._counts)
    prompts = [p + p for p in bundled[3][:3]]  # the second copy's tail matches the first: lookup has drafts
    got, records = _run(eng, [(f"s{i}", p, SamplingParams(max_tokens=40), SpecSettings(method="auto", gamma=4))
                              for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[f"s{i}"] == dec.generate(p, method="ar", max_new_tokens=40, eos_token_id=None).tokens, i
    steps = {o: sum(r.auto_steps.get(o, 0) for r in records.values()) for o in ("ngram", "eagle")}
    assert all(r.method == "eagle" for r in records.values())  # admission's drafter: the request's record
    assert steps["ngram"] > 0 and steps["eagle"] > 0, steps
    assert proposed.get("ngram", 0) > 0 and proposed.get("eagle", 0) > 0, proposed  # each ran as chosen
    tiers = {k[1] for k, v in eng.priors._counts.items() if before.get(k) != v and k[1].startswith("ngram")}
    assert tiers and tiers <= {"ngram:16+", "ngram:8-15", "ngram:3-7", "ngram:2", "ngram:1", "ngram:store"}, tiers
    assert sum(r.accepted for r in records.values()) > 0


def _sampled_engine(dec) -> Engine:
    eng = full_speculation(Engine(dec, max_batch=4, kv_cache_mb=8, eos_token_id=None))
    for _ in range(60):
        for tier in ("ngram:16+", "ngram:8-15", "ngram:3-7", "ngram:2", "ngram:1", "ngram"):
            eng.priors.observe_alpha((None, tier, True), 4, 4)
        eng.priors.observe_alpha((None, "eagle", True), 2, 4)
    ch = eng._chooser(None, True)
    ch.samples, ch.scores = {"ngram": 9, "eagle": 9}, {"ngram": 0.0, "eagle": 9.0}
    return eng


def test_seeded_sampled_auto_requests_switch_and_repeat_themselves(bundled, dec):
    prompts = [p + p for p in bundled[3][:2]]
    reqs = [(f"t{i}", p, SamplingParams(max_tokens=24, temperature=0.8, seed=i), SpecSettings(method="auto"))
            for i, p in enumerate(prompts)]
    got, records = _run(_sampled_engine(dec), reqs)
    again, _ = _run(_sampled_engine(dec), reqs)  # the same estimates and modelled costs: the same choices
    assert got == again and all(len(got[f"t{i}"]) == 24 for i in range(2))
    assert all(r.method == "eagle" and sum(r.auto_steps.values()) > 0 for r in records.values())


def test_auto_on_the_draft_model_switches_and_equals_plain_decoding(qwen2):  # noqa: F811
    eng = full_speculation(Engine(qwen2, max_batch=4, kv_cache_mb=4, eos_token_id=None))
    _lean(eng, lookup=1.0, drafter=0.5, method="draft")
    ch = eng._chooser(None, False)
    ch.samples["medusa"], ch.scores["medusa"] = 9, 0.0
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42, 43] * 4, [3, 1, 4, 1, 5, 9, 2, 6]]
    got, records = _run(eng, [(f"d{i}", p, SamplingParams(max_tokens=32), SpecSettings(method="auto", gamma=4))
                              for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[f"d{i}"] == qwen2.generate(p, method="ar", max_new_tokens=32, eos_token_id=None).tokens, i
    assert all(r.method == "draft" for r in records.values())
    steps = {o: sum(r.auto_steps.get(o, 0) for r in records.values()) for o in ("ngram", "draft")}
    assert steps["ngram"] > 0 and steps["draft"] > 0, steps


def test_only_auto_requests_on_a_chain_drafter_weigh_lookup_each_step(qwen2):  # noqa: F811
    eng = Engine(qwen2, max_batch=4, kv_cache_mb=4, eos_token_id=None, calibrate=False)
    prompt = [5, 6, 7, 8] * 4
    for i, method in enumerate(("ar", "ngram", "draft", "medusa")):  # a greedy Medusa request keeps an index too
        for temperature in (0.0, 0.8):
            eng.add(f"{method}{i}{temperature}", prompt, SamplingParams(max_tokens=4, temperature=temperature),
                    SpecSettings(method=method))
    assert all(seq.auto_step is None for seq in eng.seqs.values())
    ch = eng._chooser(None, False)
    for method in ("medusa", "draft"):  # auto admitted to Medusa keeps its heads; to the draft model it weighs
        ch.samples = {"ngram": 9, "draft": 9, "medusa": 9}
        ch.scores = {"ngram": 0.0, "draft": 9.0 if method == "draft" else 0.0, "medusa": 9.0 if method == "medusa" else 0.0}
        eng.add(f"auto-{method}", prompt, SamplingParams(max_tokens=4), SpecSettings(method="auto"))
        seq = eng.seqs[f"auto-{method}"]
        assert seq.spec.method == method and (seq.auto_step is not None) == (method == "draft")
