"""EAGLE-2 dynamic trees in the serving engine: greedy ``eagle`` requests with ``eagle_topk``.

Greedy output equals plain decoding token for token: on the bundled target (a random drafter) in
a batch beside eagle chains (greedy and sampled: a sampled request keeps the chain), plain and
Medusa requests; on a bigram target whose drafter mostly ranks as the target does, where trees
are accepted deep and off their first branch, and where a walk that accepts a wrong node is
caught. After a tree step the sequence's drafter holds what a fresh drafter fed the real
features of the accepted path holds (a feed of the tree's first rows instead is caught). A
preempted tree sequence is rebuilt and stays exact. The record counts a tree step as Medusa's
(drafted: the tree's depth, accepted: the path's length past the root). The planner offers a tree
the drafter's calibrated estimates, charges the trees' own measured overhead and declines them
when they do not pay. Bad settings are refused naming the field; the policy's ``eagle_topk``
reaches the engine and the in-process path.
"""

from __future__ import annotations

import random

import pytest
import torch

import specops.engine.engine as engine_module
from specops.decoder import Decoder
from specops.models.eagle_model import EagleDrafter
from specops.spec.eagle_tree import EagleTree
from specops.models.runner import prompt_forward
from specops.spec.tree_verify import TreeVerification
from specops.engine.acceptance import EAGLE_TREE, KIND_PRIOR_TRIALS, AcceptancePriors
from specops.engine.eagle_proposer import EagleProposer
from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings
from specops.engine.spec_planner import Meter
from tests.decoder.test_eagle3 import bigram_target
from tests.decoder.test_eagle_tree import copying_drafter
from tests.serving.test_engine import FlatCost, full_speculation

TREE = dict(method="eagle", gamma=4, eagle_topk=3, tree_size=12)


@pytest.fixture(scope="module")
def bundled():
    """The bundled target with its Medusa heads and a randomly initialised EAGLE drafter."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    base = Decoder.from_pretrained("bundled")
    model = base.target.model
    drafter = EagleDrafter.for_target(model, seed=0).eval()
    yield Decoder(model, medusa=base.medusa, eagle=drafter, tokenizer=base.tokenizer)
    torch.set_num_threads(before)


def noisy_copier(model) -> EagleDrafter:
    """A drafter for `bigram_target` that ranks tokens mostly as the target does (`copying_drafter`,
    not too sharp) with the features it reads mixed in: its trees are accepted often, sometimes off
    their first branch, and its cache depends on the features it was fed."""
    drafter = copying_drafter(model, sharpness=3.0)
    e = model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        drafter.fc.weight[:, e:] = 0.3 * torch.randn(e, e, generator=g) / e**0.5
    return drafter


@pytest.fixture(scope="module")
def bigram():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model = bigram_target(seed=0)
    yield Decoder(model, eagle=noisy_copier(model))
    torch.set_num_threads(before)


def random_prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run(eng: Engine, requests) -> tuple[dict[str, list[int]], dict[str, object]]:
    for rid, prompt, params, spec in requests:
        eng.add(rid, prompt, params, spec)
    got: dict[str, list[int]] = {}
    records: dict[str, object] = {}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                records[out.request_id] = out.record
        steps += 1
        assert steps < 5000
    return got, records


class Spy:
    """Every tree the engine's EAGLE proposer drafts (with its request) and every tree walk."""

    def __init__(self, monkeypatch) -> None:
        self.trees: list[dict] = []
        self.chains: list[str] = []
        self.walks: list[dict] = []
        propose_tree, propose = EagleProposer.propose_tree, EagleProposer.propose
        judge = engine_module.judge_tree
        by_tokens: dict[int, str] = {}

        def spy_tree(proposer, seq, depth, size):
            tree, estimates, forwards, full = propose_tree(proposer, seq, depth, size)
            by_tokens[id(tree.tokens)] = seq.request_id
            self.trees.append(dict(request=seq.request_id, tokens=tree.tokens, nodes=tree.buffers.num_nodes,
                                   depth=tree.buffers.spec.depth, allowed=(depth, size), estimates=estimates,
                                   forwards=forwards))
            return tree, estimates, forwards, full

        def spy_chain(proposer, seq, gamma):
            self.chains.append(seq.request_id)
            return propose(proposer, seq, gamma)

        def spy_judge(tokens, logits, buffers, *args, **kwargs):
            v = judge(tokens, logits, buffers, *args, **kwargs)
            request = by_tokens.get(id(tokens))
            if request is None:  # a Medusa tree
                return v
            ranks = [buffers.spec.paths[i - 1][-1] for i in v.path[1:]]  # each accepted node's rank among its siblings
            self.walks.append(dict(request=request, path=list(v.path), depth=buffers.spec.depth, ranks=ranks))
            return v

        monkeypatch.setattr(EagleProposer, "propose_tree", spy_tree)
        monkeypatch.setattr(EagleProposer, "propose", spy_chain)
        monkeypatch.setattr(engine_module, "judge_tree", spy_judge)


# ---------------------------------------------------------------------- exactness
def test_trees_on_the_bundled_target_equal_plain_decoding_in_a_mixed_batch(bundled, monkeypatch):
    """Eagle trees (two shapes), eagle chains (greedy, and sampled with eagle_topk set: the chain),
    plain and Medusa requests in one batch, joining as others run."""
    dec = bundled
    spy = Spy(monkeypatch)
    eng = full_speculation(Engine(dec, max_batch=6, kv_cache_mb=8, calibrate=False, eos_token_id=None))
    tok = dec.tokenizer
    texts = ["def fibonacci(n):\n    ", "The capital of France is", "for i in range(10):\n",
             "Once upon a time", "import numpy as np\n", "class Stack:\n    def push(self, x):"]
    prompts = [tok.encode(t) for t in texts] + random_prompts(dec.target.vocab_size, (7, 23))
    specs = [SpecSettings(**TREE), SpecSettings(method="eagle", gamma=5, eagle_topk=2, tree_size=6),
             SpecSettings(method="eagle", gamma=3), SpecSettings(method="ar"), SpecSettings(method="medusa"),
             SpecSettings(method="eagle", gamma=2, eagle_topk=4, tree_size=20), SpecSettings(**TREE),
             SpecSettings(**TREE)]
    sampled = {7}  # a sampled eagle request that asks for a tree: it keeps the chain
    requests, want = [], {}
    for i, (prompt, spec) in enumerate(zip(prompts, specs)):
        params = SamplingParams(max_tokens=32, temperature=0.8 if i in sampled else 0.0, seed=i)
        requests.append((f"r{i}", prompt, params, spec))
        if i not in sampled:
            want[f"r{i}"] = dec.generate(prompt, method="ar", max_new_tokens=32).tokens
    got, records = {}, {}
    for rid, prompt, params, spec in requests:  # one joins every other step
        eng.add(rid, prompt, params, spec)
        for out in eng.step() + eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                records[out.request_id] = out.record
    more, rest = run(eng, [])
    for rid, toks in more.items():
        got.setdefault(rid, []).extend(toks)
    records.update(rest)
    for rid in want:
        assert got[rid] == want[rid], rid
    tree_ids = {"r0", "r1", "r5", "r6"}
    assert {t["request"] for t in spy.trees} == tree_ids
    for rid in tree_ids:
        assert records[rid].method == "eagle" and records[rid].drafted > 0
    assert "r7" in spy.chains and records["r7"].drafted > 0 and len(got["r7"]) == 32
    assert "r2" in spy.chains and not any(t["request"] in ("r2", "r7") for t in spy.trees)
    assert records["r4"].method == "medusa" and records["r4"].drafted > 0
    for t in spy.trees:  # within the shape and the plan's grant
        shape = {"r0": (4, 3, 12), "r6": (4, 3, 12), "r1": (5, 2, 6), "r5": (2, 4, 20)}[t["request"]]
        assert t["depth"] <= min(shape[0], t["allowed"][0]) and t["nodes"] <= min(shape[2], t["allowed"][1])
    assert eng.stats().kv_blocks_used == 0


def test_trees_are_accepted_off_their_first_branch_and_stay_exact(bigram, monkeypatch):
    dec = bigram
    spy = Spy(monkeypatch)
    eng = full_speculation(Engine(dec, max_batch=4, kv_cache_mb=4, calibrate=False, eos_token_id=None))
    prompts = random_prompts(dec.target.vocab_size, (5, 9, 14, 20))
    got, records = run(eng, [(f"t{i}", p, SamplingParams(max_tokens=40), SpecSettings(**TREE))
                             for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[f"t{i}"] == dec.generate(p, method="ar", max_new_tokens=40).tokens, i
    paths = [w["path"] for w in spy.walks]
    assert sum(len(p) - 1 for p in paths) > 60 and max(len(p) - 1 for p in paths) > 1
    assert any(p != list(range(len(p))) for p in paths)  # the accepted rows are tree rows, not a prefix
    # nodes accepted that are not their parent's first child: the chain would have stopped before them
    assert sum(1 for w in spy.walks for rank in w["ranks"] if rank > 0) >= 3
    # the record counts a tree step as Medusa's: drafted its depth, accepted the path past the root
    for rid, rec in records.items():
        walks = [w for w in spy.walks if w["request"] == rid]
        assert rec.drafted == sum(w["depth"] for w in walks) and rec.accepted == sum(len(w["path"]) - 1 for w in walks)
        assert rec.steps == len(walks) and rec.gamma_trace == [w["depth"] for w in walks]
        # the feed of the real entries, then one forward per level but the last
        assert rec.draft_forwards == sum(t["forwards"] for t in spy.trees if t["request"] == rid)
    assert all(t["forwards"] == t["allowed"][0] for t in spy.trees)


def test_a_walk_that_accepts_a_wrong_node_is_caught(bigram, monkeypatch):
    """The exactness checks' power: a walk that takes a child of the root the target did not choose
    (and the target's token after it) no longer decodes plainly."""
    real = engine_module.judge_tree

    def wrong_child(tokens, logits, buffers, *args, **kwargs):
        v = real(tokens, logits, buffers, *args, **kwargs)
        taken = v.path[1] if len(v.path) > 1 else None
        others = [i for i in range(1, buffers.num_nodes) if int(buffers.depth[i]) == 1 and i != taken]
        if not others:
            return v
        return TreeVerification(path=[0, others[0]], next_token=int(logits[others[0]].argmax()))

    monkeypatch.setattr(engine_module, "judge_tree", wrong_child)
    eng = full_speculation(Engine(bigram, max_batch=2, kv_cache_mb=4, calibrate=False, eos_token_id=None))
    prompt = random_prompts(bigram.target.vocab_size, (9,))[0]
    got, _ = run(eng, [("w", prompt, SamplingParams(max_tokens=24), SpecSettings(**TREE))])
    assert got["w"] != bigram.generate(prompt, method="ar", max_new_tokens=24).tokens


# ---------------------------------------------------------------------- the drafter's state
def _state_after_a_tree_step(dec: Decoder, spy: Spy):
    """Run a tree sequence until a step accepted a path of tree rows that are not the tree's first
    rows; then feed its drafter what that step left (`EagleProposer.catch_up`). Returns the
    sequence's cache entries and prediction of the pending token's feature, and those of a fresh
    drafter fed the sequence's tokens with the target's real features."""
    dec.eagle.kernel_weights = "fp32"  # fed step by step against fed at once: fp32 rounding only
    eng = full_speculation(Engine(dec, max_batch=2, kv_cache_mb=4, calibrate=False, eos_token_id=None))
    prompt = random_prompts(dec.target.vocab_size, (11,), seed=4)[0]
    eng.add("s", prompt, SamplingParams(max_tokens=80), SpecSettings(**TREE))
    seq = eng.seqs["s"]
    for _ in range(60):
        walks = len(spy.walks)
        eng.step()
        path = spy.walks[-1]["path"] if len(spy.walks) > walks else []
        if len(path) > 2 and path != list(range(len(path))):
            break
    else:
        pytest.fail("no tree step accepted a path of tree rows")
    assert seq.eagle.cursor.unfed == len(path)  # the root's and the accepted nodes' rows wait for the next drafting
    drafter = dec.eagle
    n = len(seq.tokens)
    with torch.no_grad():
        mine_last = eng.eagle.catch_up(seq)
        assert seq.eagle.cursor.cache.length == n - 1
        dec.target.reset(1)
        feats = prompt_forward(dec.target, torch.tensor([seq.tokens[:-1]]), logits=False, need_hidden=True).hidden[0]
        cache = drafter.new_cache()
        theirs_last = drafter.step(torch.tensor(seq.tokens[1:]), feats, cache)[-1]
    return seq.eagle.cursor.cache.data[..., : n - 1, :], mine_last, cache.data[..., : n - 1, :], theirs_last


def test_after_a_tree_step_the_drafter_holds_the_accepted_paths_real_features(bigram, monkeypatch):
    spy = Spy(monkeypatch)
    mine, mine_last, theirs, theirs_last = _state_after_a_tree_step(bigram, spy)
    torch.testing.assert_close(mine, theirs, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(mine_last, theirs_last, atol=2e-4, rtol=2e-4)


def test_feeding_the_trees_first_rows_instead_of_the_paths_is_caught(bigram, monkeypatch):
    """The state check's power: a commit that reads the tree's first rows (as a chain's are) instead
    of the accepted path's leaves the drafter off the real features."""
    commit = EagleProposer.commit
    monkeypatch.setattr(EagleProposer, "commit", lambda self, seq, deadline_passed, path=None:
                        commit(self, seq, deadline_passed))
    spy = Spy(monkeypatch)
    mine, mine_last, theirs, theirs_last = _state_after_a_tree_step(bigram, spy)
    assert not torch.allclose(mine, theirs, atol=2e-4, rtol=2e-4)


def test_preempted_tree_sequences_rebuild_their_drafter_state_and_stay_exact(bigram, monkeypatch):
    spy = Spy(monkeypatch)
    prompts = random_prompts(bigram.target.vocab_size, (20, 18, 22, 16, 21, 19), seed=7)
    eng = full_speculation(Engine(bigram, max_batch=6, kv_cache_mb=0.15, block_size=8, calibrate=False,
                                  eos_token_id=None))
    assert eng.pool.capacity_slots < 3 * 60  # two or three of the six sequences at a time
    want = {f"p{i}": bigram.generate(p, method="ar", max_new_tokens=40).tokens for i, p in enumerate(prompts)}
    for i, p in enumerate(prompts):
        eng.add(f"p{i}", p, SamplingParams(max_tokens=40), SpecSettings(**TREE))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        for seq in eng.seqs.values():  # a preempted sequence's drafter state goes with its blocks
            assert seq.target.blocks or (seq.eagle.cursor.cache is None and seq.eagle.cursor.unfed == 0)
    assert eng.stats().preemptions > 0
    assert got == want
    assert sum(len(w["path"]) - 1 for w in spy.walks) > 40
    assert eng.stats().kv_blocks_used == 0


# ---------------------------------------------------------------------- the plan
class Fixed(Meter):
    """An overhead meter that reads ``seconds`` whatever is observed."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def observe(self, value: float) -> None:
        pass

    def value(self, default: float = 0.0) -> float:
        return self.seconds


def test_the_planner_declines_trees_whose_measured_overhead_does_not_pay(bigram, monkeypatch):
    """Trees are charged their own measured overhead, apart from eagle chains': at 100 s a tree
    (a forward costs 1 s) the plan declines every tree, while a chain (no overhead) speculates."""
    spy = Spy(monkeypatch)
    eng = full_speculation(Engine(bigram, max_batch=4, kv_cache_mb=4, calibrate=False, eos_token_id=None))
    eng.accounts.overhead[EAGLE_TREE] = Fixed(100.0)
    eng.schedule.probe_every = 10**9  # no cost probe runs a declined plan
    prompts = random_prompts(bigram.target.vocab_size, (9, 13, 17))
    chain, chained = run(eng, [("c", prompts[2], SamplingParams(max_tokens=30), SpecSettings(method="eagle", gamma=3))])
    assert chained["c"].drafted > 0
    got, records = run(eng, [(f"d{i}", p, SamplingParams(max_tokens=30), SpecSettings(**TREE))
                             for i, p in enumerate(prompts[:2])])
    for i, p in enumerate(prompts[:2]):
        assert got[f"d{i}"] == bigram.generate(p, method="ar", max_new_tokens=30).tokens
    assert spy.trees == [] and records["d0"].drafted == records["d1"].drafted == 0
    assert chain["c"] == bigram.generate(prompts[2], method="ar", max_new_tokens=30).tokens


def test_trees_measure_their_own_overhead(bigram):
    eng = Engine(bigram, max_batch=2, kv_cache_mb=4, calibrate=False, eos_token_id=None)
    eng.cost, eng.calibration, eng.schedule.quiet_after_decline = FlatCost(), None, 0
    prompt = random_prompts(bigram.target.vocab_size, (9,))[0]
    got, records = run(eng, [("m", prompt, SamplingParams(max_tokens=30), SpecSettings(**TREE))])
    assert got["m"] == bigram.generate(prompt, method="ar", max_new_tokens=30).tokens
    assert records["m"].drafted > 0
    assert len(eng.accounts.overhead[EAGLE_TREE].values) > 0 and len(eng.accounts.overhead["eagle"].values) == 0


def test_a_tree_is_offered_the_drafters_calibrated_estimates(bigram):
    """Before its kind drafted a tree, a sequence's offer is a chain's for the tree's depth; then the
    k-th node gains what the drafter estimated of the kind's k-th best nodes, times what such trees
    accepted per estimated token; near the budget's end the tree's levels, and so its nodes, shrink."""
    eng = full_speculation(Engine(bigram, max_batch=2, kv_cache_mb=4, calibrate=False, eos_token_id=None))
    prompts = random_prompts(bigram.target.vocab_size, (9, 12))
    eng.add("a", prompts[0], SamplingParams(max_tokens=60), SpecSettings(**TREE))
    eng.step()  # the prompt pass
    seq = eng.seqs["a"]
    key = eng.trees.tree_key(seq)
    assert eng.priors.profile(key) is None
    first = eng.trees.tree_candidate(seq, 10, 0.0)
    assert first.gains == eng.priors.gains(seq.prior_key, "eagle", seq.alpha, TREE["gamma"])
    for _ in range(6):
        eng.step()
    profile = eng.priors.profile(key)
    assert len(profile) == TREE["tree_size"] - 1 and profile == sorted(profile, reverse=True)
    assert seq.accept_scale != 1.0  # calibrated on what the trees accepted
    offer = eng.trees.tree_candidate(seq, 10, 0.0)
    assert offer.gains == [min(g * seq.accept_scale, 1.0) for g in profile]
    assert eng.trees.tree_depth["a"] == TREE["gamma"]
    short = eng.trees.tree_candidate(seq, 1, 0.0)  # one level: the root's topk children at most
    assert eng.trees.tree_depth["a"] == 1 and short.gains == offer.gains[: TREE["eagle_topk"]]


def test_tree_calibration_is_a_ratio_of_sums():
    """A tree the drafter expected almost nothing of weighs what it expected: one lucky token does
    not make every estimate a certainty; many trees move the scale to what they really accepted."""
    priors = AcceptancePriors()
    key = ("c", "eagle", False, EAGLE_TREE, 4, 3)
    priors.observe_tree(key, 1, 0.001)
    assert priors.tree_scale(key) == pytest.approx((1 + KIND_PRIOR_TRIALS) / (0.001 + KIND_PRIOR_TRIALS))
    for _ in range(300):
        priors.observe_tree(key, 1, 2.0)
    assert 0.5 < priors.tree_scale(key) < 0.55  # half of it accepted (the drafter's word weighs 4 tokens)
    priors.observe_profile(key, [0.9, 0.5, 0.2])
    priors.observe_profile(key, [0.1, 0.05, 0.04, 0.03, 0.3])
    got = priors.profile(key)
    assert len(got) == 5 and got == sorted(got, reverse=True) and got[0] == pytest.approx(0.82)


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize("value", [0, 33, True, 2.0, "3"])
def test_bad_eagle_topk_is_refused_naming_the_field(bigram, value):
    eng = Engine(bigram, max_batch=2, kv_cache_mb=4, calibrate=False)
    with pytest.raises(ValueError, match="eagle_topk must be an integer in 1..32"):
        eng.add("x", [1, 2, 3], SamplingParams(max_tokens=4), SpecSettings(method="eagle", eagle_topk=value))
    assert not eng.has_unfinished()


def test_the_tree_shape_follows_gamma_topk_and_tree_size():
    assert SpecSettings(**TREE).eagle_tree() == (4, 3, 12)
    assert SpecSettings(method="eagle", eagle_topk=4).eagle_tree() == (4, 4, 16)  # tree_size None: 16
    assert SpecSettings(method="eagle", gamma=1, eagle_topk=4, tree_size=16).eagle_tree() == (1, 4, 5)  # what it drafts
    assert SpecSettings(method="eagle", gamma=0, eagle_topk=4).eagle_tree() is None  # no drafts
    assert SpecSettings(method="eagle", eagle_topk=4, tree_size=1).eagle_tree() is None  # the root alone
    assert SpecSettings(method="eagle").eagle_tree() is None  # the chain
    assert SpecSettings(method="medusa", eagle_topk=4).eagle_tree() is None  # other methods ignore it
    for gamma in range(1, 9):
        for k in (1, 2, 5, 32):
            for size in (2, 3, 16, 64):
                EagleTree(*SpecSettings(method="eagle", gamma=gamma, eagle_topk=k, tree_size=size).eagle_tree())


def test_a_policy_classs_eagle_topk_reaches_the_engine_and_the_in_process_path(bigram, monkeypatch):
    from specops.engine.policy_runtime import PolicyRuntime
    from specops.policies.schema import Policy

    policy = Policy.model_validate({
        "version": 1, "default_class": "code",
        "classes": [{"name": "code", "method": "eagle", "eagle_topk": 3, "gamma": {"initial": 4, "min": 1, "max": 6},
                     "tree_size": {"initial": 12, "min": 4, "max": 32}},
                    {"name": "chat", "method": "eagle", "match": [{"prefix": "hi"}]}]})
    runtime = PolicyRuntime(bigram, policy)
    res = runtime.resolve("def f():", 4)
    assert (res.spec.method, res.spec.eagle_topk, res.spec.eagle_tree()) == ("eagle", 3, (4, 3, 12))
    assert runtime.resolve("hi there", 2).spec.eagle_topk is None
    calls = []
    generate = Decoder.generate

    def spy(self, prompt, **kwargs):
        calls.append(kwargs)
        return generate(self, prompt, **kwargs)

    monkeypatch.setattr(Decoder, "generate", spy)
    prompt = random_prompts(bigram.target.vocab_size, (9,))[0]
    served = runtime.serve(prompt, max_new_tokens=20)
    assert calls[0]["eagle_tree"] == (4, 3, 12) and served.stats.drafted > 0
    assert served.tokens == generate(bigram, prompt, method="ar", max_new_tokens=20).tokens
    eng = full_speculation(Engine(bigram, max_batch=2, kv_cache_mb=4, calibrate=False, eos_token_id=None))
    eng.add("p", prompt, SamplingParams(max_tokens=4), res.spec)
    assert eng.seqs["p"].eagle.shape == EagleTree(4, 3, 12)


def test_eagle_topk_on_a_class_of_another_method_is_refused():
    from pydantic import ValidationError

    from specops.policies.schema import Policy

    for method in ("draft", "medusa", "ngram"):
        with pytest.raises(ValidationError, match="eagle_topk shapes the eagle method's tree"):
            Policy.model_validate({"version": 1, "default_class": "c",
                                   "classes": [{"name": "c", "method": method, "eagle_topk": 4}]})
    with pytest.raises(ValidationError, match="less than or equal to 32"):
        Policy.model_validate({"version": 1, "default_class": "c",
                               "classes": [{"name": "c", "method": "eagle", "eagle_topk": 33}]})
