"""The engine's Medusa step offers what ``Decoder.generate(method="medusa")`` offers: a greedy
request's prompt-lookup branch merged into its tree (exact: the engine's output stays plain
decoding's, the branch fires and takes forwards away, within the budget, the context and the
tree's node bound), and, for sampled requests that ask for it, LOSSY typical acceptance."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

import specops.engine.engine as engine_module
from specops.decoder import Decoder
from specops.spec import tree_verify
from specops.spec.medusa_branch import LOOKUP_BRANCH
from specops.models.medusa_heads import MedusaHeads
from specops.engine.engine import Engine
from specops.engine.metrics import ServingMetrics
from specops.engine.proposers import MedusaProposer
from specops.engine.sequence import SamplingParams, SpecSettings
from tests.decoder.tiny_models import tiny_other
from tests.serving.test_engine import full_speculation, run_staggered


@pytest.fixture(scope="module")
def bundled():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Decoder.from_pretrained("bundled")
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def qwen2():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tiny_other("qwen2", seed=5, vocab=96, max_positions=96)
    yield Decoder(target, medusa=MedusaHeads.from_model(target, 3))
    torch.set_num_threads(before)


class Trees:
    """Records every tree the engine's Medusa proposer hands out, with its sequence's state then."""

    def __init__(self, monkeypatch, engine: Engine) -> None:
        self.seen: list[dict] = []
        propose = MedusaProposer.propose

        def recorded(proposer, seqs, specs, branches=None):
            out = propose(proposer, seqs, specs, branches)
            for seq, (tokens, buffers), branch in zip(seqs, out, branches or [[]] * len(seqs)):
                self.seen.append(dict(request=seq.request_id, nodes=buffers.num_nodes, appended=buffers.appended,
                                      depth=int(buffers.depth.max()), branch=list(branch), remaining=seq.remaining,
                                      room=engine.max_model_len - len(seq.tokens), planned=seq.stats.gamma,
                                      bound=seq.spec.tree_size, tokens=tokens.tolist()))
            return out

        monkeypatch.setattr(MedusaProposer, "propose", recorded)


def repeating_prompts(n: int, seed: int, vocab: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(vocab) for _ in range(rng.randint(3, 7))]
        out.append((motif * 5)[: rng.randint(9, 30)])  # its last three tokens occurred before
    return out


def run(eng: Engine, prompts: list[list[int]], max_tokens, spec_kw=None, temperature: float = 0.0):
    requests = []
    for i, prompt in enumerate(prompts):
        kw = dict(tree_size=4 + 4 * (i % 4)) | (spec_kw or {})
        budget = max_tokens(i) if callable(max_tokens) else max_tokens
        requests.append((f"medusa-{i}", prompt, SamplingParams(max_tokens=budget, temperature=temperature, seed=i),
                         SpecSettings(method="medusa", **kw)))
    return run_staggered(eng, requests)


def test_greedy_branches_stay_exact_and_take_forwards_away_on_code(bundled, monkeypatch):
    """Held-out code whose prompt repeats part of itself: with the branch the same requests take
    fewer target forwards (every step takes its whole offer here: `full_speculation`), and the
    output stays plain decoding's."""
    from specops.train.data import code_prompts, split_stdlib

    texts = code_prompts(split_stdlib().heldout_files, count=8, max_chars=300, seed=7)
    prompts = [bundled.tokenizer.encode(t + "\n" + t[: len(t) // 2]) for t in texts]
    want = [bundled.generate(p, method="ar", max_new_tokens=64).tokens for p in prompts]
    forwards, stats = {}, {}
    for branch in (0, LOOKUP_BRANCH):
        eng = full_speculation(Engine(bundled, max_batch=4, kv_cache_mb=16))
        trees = Trees(monkeypatch, eng)
        got, records, _ = run(eng, prompts, 64, {"tree_size": 12, "lookup_branch": branch})
        for i, tokens in enumerate(want):
            assert got[f"medusa-{i}"] == tokens, (branch, i)
        forwards[branch] = sum(r.target_forwards for r in records.values())
        stats[branch] = eng.stats()
        assert all(t["nodes"] <= 12 for t in trees.seen)  # the branch's nodes count against the tree's bound
        assert any(t["appended"] for t in trees.seen) == (branch > 0)
        assert eng.stats().kv_blocks_used == 0
    assert stats[0].medusa_branches == stats[0].medusa_branch_tokens == 0
    assert stats[LOOKUP_BRANCH].medusa_branches > 10 and stats[LOOKUP_BRANCH].medusa_branch_tokens > 20, stats
    assert forwards[LOOKUP_BRANCH] < 0.93 * forwards[0], forwards


def test_greedy_branches_keep_to_the_budget_the_context_and_the_node_bound(qwen2, monkeypatch):
    """Random heads on a random target whose greedy output soon repeats itself: the branch fires,
    the engine's output equals plain decoding's up to EOS, the budget and the context's end, and
    every tree the heads and the branch make stays within the step's drafts (remaining - 1), the
    context and the planned nodes (the KV slots granted) and the tree's bound."""
    eng = full_speculation(Engine(qwen2, max_batch=4, kv_cache_mb=1, eos_token_id=[3]))
    trees = Trees(monkeypatch, eng)
    prompts = repeating_prompts(12, seed=4)
    budgets = [random.Random(i).choice([5, 20, 60, 200]) for i in range(len(prompts))]
    got, records, max_batch = run(eng, prompts, lambda i: budgets[i])
    stops = set()
    for i, prompt in enumerate(prompts):
        want = qwen2.generate(prompt, method="ar", max_new_tokens=budgets[i], eos_token_id=[3]).tokens
        assert got[f"medusa-{i}"] == want, i
        stops.add(records[f"medusa-{i}"].stop_reason)
    assert max_batch > 1 and eng.stats().kv_blocks_used == 0
    assert {"max_new_tokens", "context"} <= stops, stops
    branched = [t for t in trees.seen if t["branch"]]
    assert eng.stats().medusa_branches == len(branched) > 10 and eng.stats().medusa_branch_tokens > 0
    assert any(t["appended"] for t in branched)
    registry = CollectorRegistry()  # /metrics shows the same counts
    ServingMetrics(registry).engine(eng.stats())
    assert registry.get_sample_value("specops_serving_medusa_branch_steps") == eng.stats().medusa_branches
    assert registry.get_sample_value("specops_serving_medusa_branch_tokens") == eng.stats().medusa_branch_tokens
    for t in trees.seen:
        assert t["depth"] <= t["remaining"] - 1 and len(t["branch"]) <= t["remaining"] - 1
        assert t["nodes"] - 1 <= min(t["room"], t["planned"])  # the granted slots hold the merged tree
        assert t["nodes"] <= t["bound"]
        cut = len(t["tokens"]) - t["appended"]  # the appended nodes: the branch's tail the tree lacked
        assert t["tokens"][cut:] == t["branch"][len(t["branch"]) - t["appended"]:]


def test_the_plan_offers_the_branch_beside_the_heads_nodes(qwen2):
    eng = full_speculation(Engine(qwen2, max_batch=2, kv_cache_mb=1))
    prompt = [7, 8, 9, 10, 11, 7, 8, 9]  # the context ends in 7 8 9, which 10 11 7 8 9 followed
    eng.add("r", prompt, SamplingParams(max_tokens=40), SpecSettings(method="medusa", tree_size=6))
    seq = eng.seqs["r"]
    seq.hidden = torch.zeros(1)  # as after its prefill: the heads may propose
    heads = [min(g * seq.accept_scale, 1.0) for g in eng.medusa.gains(seq.heads, 6, max_depth=30)]
    candidate = eng._candidate(seq, bound=30)
    offer = eng.trees.branches["r"]
    assert offer.tokens == [10, 11, 7, 8] and offer.heads == heads  # LOOKUP_BRANCH tokens after a 3-token match
    assert len(candidate.gains) == 5 and candidate.gains == offer.gains()  # a tree of 6 nodes holds 5 more
    assert candidate.gains == sorted(candidate.gains, reverse=True)
    assert offer.branch == sorted(offer.branch, reverse=True) and len(offer.branch) == 4
    for extra in range(6):
        nodes, branch = offer.split(extra)
        assert nodes + len(branch) == extra and branch == offer.tokens[: len(branch)]
        assert nodes == sum(1 for take in offer.mix[:extra] if not take)
    eng._candidate(seq, bound=2)
    assert eng.trees.branches["r"].tokens == [10, 11]  # no more than the step may draft
    # once the class's branches were accepted deep, the branch outbids the heads' weaker nodes
    key = eng.trees.branch_key(seq)
    for _ in range(40):
        eng.priors.observe_alpha(key, 4, 4)
    assert sum(eng._candidate(seq, bound=30) and eng.trees.branches["r"].mix) > sum(offer.mix)
    eng.trees.branches.clear()
    seq.ngram = engine_module.context_index([1, 2, 3, 4])  # no match: the heads' nodes alone
    assert eng._candidate(seq, bound=30).gains == heads and "r" not in eng.trees.branches


def test_lookup_branch_zero_and_sampled_requests_keep_no_index(qwen2):
    eng = Engine(qwen2, max_batch=4, kv_cache_mb=1, calibrate=False)
    eng.add("off", [1, 2, 3], SamplingParams(max_tokens=4), SpecSettings(method="medusa", lookup_branch=0))
    eng.add("sampled", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.8),
            SpecSettings(method="medusa"))
    eng.add("greedy", [1, 2, 3], SamplingParams(max_tokens=4), SpecSettings(method="medusa"))
    assert eng.seqs["off"].ngram is None and eng.seqs["sampled"].ngram is None
    assert eng.seqs["greedy"].ngram.tokens == [1, 2, 3]


def test_typical_acceptance_runs_only_for_sampled_medusa_requests_that_ask(qwen2, monkeypatch):
    calls = []
    typical = tree_verify.verify_tree_typical

    def counted(*args, **kwargs):
        calls.append(args[2].num_nodes)
        return typical(*args, **kwargs)

    monkeypatch.setattr(tree_verify, "verify_tree_typical", counted)  # the rule `judge_tree` applies
    prompts = repeating_prompts(4, seed=9)
    for temperature, typical_on, expect in ((0.8, False, False), (0.8, True, True), (0.0, True, False)):
        calls.clear()
        eng = full_speculation(Engine(qwen2, max_batch=4, kv_cache_mb=1))
        got, records, _ = run(eng, prompts, 24, {"typical": typical_on}, temperature=temperature)
        assert bool(calls) == expect, (temperature, typical_on)
        assert all(r.new_tokens == 24 for r in records.values())
        if temperature == 0.0:  # greedy requests ignore it: still plain decoding's tokens
            for i, prompt in enumerate(prompts):
                assert got[f"medusa-{i}"] == qwen2.generate(prompt, method="ar", max_new_tokens=24).tokens
        assert eng.stats().medusa_branches == 0 or temperature == 0.0  # sampled requests take no branch


def test_auto_never_runs_typical_acceptance(qwen2):
    eng = Engine(qwen2, max_batch=2, kv_cache_mb=1, calibrate=False)
    eng.add("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.8), SpecSettings(method="auto", typical=True))
    assert eng.seqs["a"].spec.typical is False


@pytest.mark.parametrize("spec, field", [
    (SpecSettings(method="medusa", lookup_branch=-1), "lookup_branch"),
    (SpecSettings(method="medusa", lookup_branch=65), "lookup_branch"),
    (SpecSettings(method="medusa", lookup_branch=True), "lookup_branch"),
    (SpecSettings(method="medusa", lookup_branch=2.0), "lookup_branch"),
    (SpecSettings(method="medusa", typical="yes"), "typical"),
    (SpecSettings(method="medusa", typical=1), "typical"),
])
def test_bad_medusa_settings_are_refused_naming_the_field(qwen2, spec, field):
    eng = Engine(qwen2, max_batch=2, kv_cache_mb=1, calibrate=False)
    with pytest.raises(ValueError, match=field):
        eng.add("bad", [1, 2, 3], SamplingParams(max_tokens=4), spec)
    assert not eng.has_unfinished()
