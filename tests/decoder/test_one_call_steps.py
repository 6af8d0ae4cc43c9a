"""Greedy steps in one C call on the fast runner against the step-by-step code.

`generate_medusa` runs each greedy step of a fast runner with C-kernel heads as one call
(tree from the last candidates, layer stack, walk, cache compaction, next candidates,
`FastLlamaRunner.medusa_loop`); plain decoding, and the verification of a drafted block
(draft model, n-gram, auto) run their forward and greedy count as one call
(`FastLlamaRunner.block_verifier`). Each must give the same tokens, the same statistics and
the same cache bits as the code it replaces, with EOS, budgets, a small context window, the
deadline and every head count.
"""

from __future__ import annotations

import random

import pytest
import torch

import specops.spec.medusa_decode as medusa_decode
from specops.spec.autoregressive import generate_ar
from specops.spec.draft import generate_draft
from specops.models.fast_llama import BlockVerifier, FastLlamaRunner, MedusaSteps
from specops.spec.ngram import generate_ngram
from specops.spec.medusa_decode import generate_medusa
from specops.models.medusa_heads import MedusaHeads
from specops.spec.sampling import SamplingConfig, make_generator
from specops.spec.tree import PRESETS, preset
from specops.kernels import cpu_linear
from tests.decoder.medusa_models import tiny_model
from tests.decoder.test_medusa import distilled_heads

GREEDY = SamplingConfig()
VOCAB = 48

@pytest.fixture(scope="module")
def case():
    assert cpu_linear.available(), cpu_linear.unavailable_reason()  # CI builds the kernels: never a skip
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_model("qwen2", vocab=VOCAB, seed=11, context=64)
    heads = distilled_heads(model, 3, 11, shared=True)
    yield FastLlamaRunner(model), heads
    torch.set_num_threads(before)


class Counting:
    """Counts the C steps taken (so no comparison below passes with the C loop unused)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        step = MedusaSteps.step

        def counted(steps, tree, root, branch=None):
            self.calls += 1
            self.branches += bool(branch)
            return step(steps, tree, root, branch)

        self.branches = 0

        monkeypatch.setattr(MedusaSteps, "step", counted)


def step_by_step(monkeypatch):
    monkeypatch.setattr(medusa_decode, "c_steps", lambda *args, **kwargs: None)


def run(runner, heads, prompt, **kwargs):
    tokens, stats = generate_medusa(runner, torch.tensor([prompt]), heads=heads, sampling=GREEDY,
                                    generator=make_generator(0), **kwargs)
    cache = runner.cache.data[:, :, :, :, : runner.cache.length].clone()
    return tokens, stats, cache


def test_c_steps_equal_the_step_by_step_loop(case, monkeypatch):
    runner, heads = case
    counter = Counting(monkeypatch)
    rng = random.Random(5)
    trees = [name for name in PRESETS if preset(name, 3).num_nodes <= 16] + [[(0,), (1,), (0, 0), (0, 0, 0)]]
    stops = {"eos": 0, "context": 0, "max_new_tokens": 0}
    accepted = 0
    for i in range(60):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        tree = trees[i % len(trees)]
        kwargs = dict(max_new_tokens=rng.randint(1, 60), num_heads=rng.randint(1, 3) if isinstance(tree, str) else 3,
                      tree=tree, eos_token_id=None, lookup_branch=0)  # the step-by-step loop has no lookup branch
        if i % 4 == 0:  # an EOS id the output reaches (a token of its plain continuation)
            plain, _ = generate_ar(runner, torch.tensor([prompt]), sampling=GREEDY, generator=make_generator(0),
                                   max_new_tokens=kwargs["max_new_tokens"])
            kwargs["eos_token_id"] = plain[rng.randrange(len(plain))]
        before = counter.calls
        got, stats, cache = run(runner, heads, prompt, **kwargs)
        # every step that drafts runs in one C call (a step the budget leaves no draft is a plain one)
        assert counter.calls - before == sum(1 for g in stats.gamma_trace if g > 0)
        with monkeypatch.context() as m:
            step_by_step(m)
            want, want_stats, want_cache = run(runner, heads, prompt, **kwargs)
        ar, _ = generate_ar(runner, torch.tensor([prompt]), sampling=GREEDY, generator=make_generator(0),
                            max_new_tokens=kwargs["max_new_tokens"], eos_token_id=kwargs["eos_token_id"])
        assert got == want == ar, f"prompt {i}: {kwargs}"
        for field in ("target_forwards", "drafted_per_pos", "accepted_per_pos", "head_predictions", "head_correct",
                      "stop_reason"):
            assert getattr(stats, field) == getattr(want_stats, field), (i, field)
        assert torch.equal(cache, want_cache), f"prompt {i}: the caches differ"
        stops[stats.stop_reason] += 1
        accepted += stats.accepted
    assert counter.calls > 200 and accepted > 100, (counter.calls, accepted)
    assert all(stops.values()), stops  # EOS, the context's end and the budget all occurred


def test_the_lookup_branch_is_exact(case, monkeypatch):
    """Greedy output with the prompt-lookup branch equals plain decoding, for fixed trees, EOS,
    budgets and the context's end (its acceptance on real text: test_medusa_bundled)."""
    runner, heads = case
    counter = Counting(monkeypatch)
    rng = random.Random(8)
    trees = ["chain", "small", [(0,), (1,), (0, 0)], "medium"]
    stops = set()
    for i in range(40):
        unit = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        prompt = (unit * 4)[: rng.randint(8, 20)]  # repeats: full 3-gram matches from the first step
        kwargs = dict(max_new_tokens=rng.randint(20, 60), tree=trees[i % len(trees)], eos_token_id=None)
        ar, _ = generate_ar(runner, torch.tensor([prompt]), sampling=GREEDY, generator=make_generator(0),
                            max_new_tokens=kwargs["max_new_tokens"])
        if i % 5 == 0:
            kwargs["eos_token_id"] = ar[rng.randrange(len(ar))]
            ar = ar[: ar.index(kwargs["eos_token_id"]) + 1]
        for branch in (0, 8):
            got, stats, _ = run(runner, heads, prompt, lookup_branch=branch, **kwargs)
            assert got == ar, (i, branch, kwargs)
            assert stats.new_tokens == len(got)
            stops.add(stats.stop_reason)
    assert counter.branches >= 8, counter.branches
    assert stops == {"eos", "max_new_tokens", "context"}, stops


def test_a_branch_merges_into_the_tree_like_a_trie(case):
    runner, heads = case
    runner.reset(1)
    runner.forward(torch.tensor([[1, 2, 3]]))
    k, tk = 2, 2
    steps = runner.medusa_loop(heads.kernel_weights(k, tk), k, tk, 8)
    tree = medusa_decode.c_tree(preset("chain", k), tk)  # root, head 0's top-1, head 1's top-1 under it
    n = tree.shape[1]
    assert n == 3
    fed = []
    for branch in ("empty", "none", "top1", "top1+", "other", "long"):
        runner.cache.length = 3
        cands = steps.cands.tolist()
        top1 = [cands[0], cands[tk]]
        other = next(t for t in range(VOCAB) if t not in (cands[0], cands[1]))
        tokens = {"empty": [], "none": None, "top1": top1, "top1+": top1 + [5, 6], "other": [other, 7],
                  "long": [other] * 12}[branch]
        snapshot = steps.cands.clone()
        steps.step(tree, 4, tokens)
        fed.append(steps._last[0])
        steps.cands.copy_(snapshot)  # the same candidates for every case
    # no branch; the heads' own chain (merged: no new node); two more under it; a new child of the
    # root and its child; a long one cut at max_nodes
    assert fed == [n, n, n, n + 2, n + 2, 8], fed
    with pytest.raises(ValueError, match="out of range"):
        steps.step(tree, 4, [VOCAB])
    runner.cache.length = runner.max_context - 4
    with pytest.raises(ValueError, match="does not fit"):
        steps.step(tree, 4, [1, 2])


def test_planned_trees_take_the_c_steps_and_past_the_deadline_plain_steps(case, monkeypatch):
    runner, heads = case
    counter = Counting(monkeypatch)
    prompt = [3, 7, 1, 9]
    ar, _ = generate_ar(runner, torch.tensor([prompt]), sampling=GREEDY, generator=make_generator(0),
                        max_new_tokens=40)
    got, stats, _ = run(runner, heads, prompt, max_new_tokens=40)  # the cost-planned tree
    assert got == ar and counter.calls == stats.steps > 0
    before = counter.calls
    got, stats, _ = run(runner, heads, prompt, max_new_tokens=40, deadline_s=1e-9)
    assert got == ar and stats.fallback_reason == "deadline" and stats.accepted == 0
    # past the deadline every step is the verifier's plain step (its one-call block check), no tree
    assert counter.calls == before and stats.target_forwards == 1 + 40


def test_sampling_and_unshared_heads_keep_the_step_by_step_loop(case, monkeypatch):
    runner, heads = case
    counter = Counting(monkeypatch)
    generate_medusa(runner, torch.tensor([[1, 2, 3]]), heads=heads, sampling=SamplingConfig(temperature=0.8),
                    generator=make_generator(0), max_new_tokens=12)
    own = MedusaHeads.from_model(tiny_model("qwen2", vocab=VOCAB, seed=11, context=64), num_heads=2)
    generate_medusa(runner, torch.tensor([[1, 2, 3]]), heads=own, sampling=GREEDY, generator=make_generator(0),
                    max_new_tokens=12)
    assert counter.calls == 0


def test_a_bad_tree_or_token_is_refused_before_the_cache_changes(case):
    runner, heads = case
    runner.reset(1)
    runner.forward(torch.tensor([[1, 2, 3]]))
    weights = heads.kernel_weights(2, 4)
    steps = runner.medusa_loop(weights, 2, 4, 8)
    assert steps is not None and runner.medusa_loop(weights, 2, 4, 17) is None
    tree = medusa_decode.c_tree(preset("small", 2).limit(max_nodes=8), 4)
    snapshot = runner.cache.data.clone()
    for root in (-1, VOCAB):
        with pytest.raises(ValueError, match="out of range"):
            steps.step(tree, root)
    for branch in ([VOCAB], [1, -1]):
        with pytest.raises(ValueError, match="out of range"):
            steps.step(tree, 1, branch)
    steps.cands.fill_(VOCAB + 5)  # candidates no embedding row holds
    with pytest.raises(ValueError, match="out of range"):
        steps.step(tree, 1)
    big = medusa_decode.c_tree(preset("large", 3), 8)
    with pytest.raises(ValueError, match="does not fit"):
        steps.step(big, 1)
    assert runner.cache.length == 3 and torch.equal(runner.cache.data, snapshot)


class CountingBlocks:
    def __init__(self, monkeypatch):
        self.calls = 0
        verify = BlockVerifier.verify

        def counted(block, tokens):
            self.calls += 1
            return verify(block, tokens)

        monkeypatch.setattr(BlockVerifier, "verify", counted)


def test_block_verification_in_one_call_equals_the_forward_path(case, monkeypatch):
    """ar, the draft model and n-gram lookup with and without `FastLlamaRunner.block_verifier`:
    the same tokens, stats and cache bits; blocks on an empty cache (a 1-token prompt) take the
    forward path, as `forward` itself does."""
    runner, _ = case
    draft = FastLlamaRunner(tiny_model("qwen2", vocab=VOCAB, seed=12, context=64))
    counter = CountingBlocks(monkeypatch)
    rng = random.Random(9)

    def decode(method, prompt, max_new, eos):
        kwargs = dict(sampling=GREEDY, generator=make_generator(0), max_new_tokens=max_new, eos_token_id=eos)
        ids = torch.tensor([prompt])
        if method == "ar":
            out = generate_ar(runner, ids, **kwargs)
        elif method == "draft":
            out = generate_draft(runner, draft, ids, **kwargs)
        else:
            out = generate_ngram(runner, ids, **kwargs)
        return out, runner.cache.data[:, :, :, :, : runner.cache.length].clone()

    steps = 0
    for i in range(45):
        method = ("ar", "draft", "ngram")[i % 3]
        prompt = [rng.randrange(VOCAB) for _ in range(1 if i % 5 == 0 else rng.randint(2, 14))]
        max_new, eos = rng.randint(1, 50), rng.randrange(VOCAB) if i % 4 == 0 else None
        before = counter.calls
        (got, stats), cache = decode(method, prompt, max_new, eos)
        used = counter.calls - before
        with monkeypatch.context() as m:
            m.setattr(FastLlamaRunner, "block_verifier", lambda self: None)
            (want, want_stats), want_cache = decode(method, prompt, max_new, eos)
        assert got == want, (i, method)
        assert torch.equal(cache, want_cache), (i, method)
        for field in ("target_forwards", "drafted", "accepted", "stop_reason", "steps"):
            assert getattr(stats, field) == getattr(want_stats, field), (i, method, field)
        assert used <= stats.steps and (used > 0 or stats.steps == 0 or len(prompt) == 1), (i, method, used)
        steps += used
    assert steps > 300, steps
    counter.calls = 0
    generate_ar(runner, torch.tensor([[1, 2, 3]]), sampling=SamplingConfig(temperature=0.7),
                generator=make_generator(0), max_new_tokens=10)
    assert counter.calls == 0  # sampling keeps the forward (its logits are drawn from)


def test_a_bad_block_is_refused_before_the_cache_changes(case):
    runner, _ = case
    runner.reset(1)
    block = runner.block_verifier()
    assert block is runner.block_verifier()  # one per cache allocation, reused
    assert not block.applies(2)  # an empty cache: `forward` would not take the C stack for 2 tokens
    runner.forward(torch.tensor([[1, 2, 3]]))
    snapshot = runner.cache.data.clone()
    with pytest.raises(ValueError, match="out of range"):
        block.verify([1, VOCAB])
    with pytest.raises(ValueError, match="not a one-call verification"):
        block.verify([1] * (block.max_tokens + 1))
    assert runner.cache.length == 3 and torch.equal(runner.cache.data, snapshot)
    n, nxt = block.verify([4, 5])
    assert runner.cache.length == 5 and 0 <= n <= 1 and 0 <= nxt < VOCAB


def test_auto_runs_its_greedy_medusa_steps_in_one_call(case, monkeypatch):
    """`generate_auto`'s Medusa steps on the fast runner are the one-call step (the heads run
    first only after another option's step): its output stays ar's, EOS and budgets included,
    and the step-by-step Medusa step is not used."""
    from specops.spec.auto import AutoEstimates, generate_auto

    runner, heads = case
    counter = Counting(monkeypatch)
    monkeypatch.setattr(medusa_decode.MedusaProposer, "propose",
                        lambda *a, **k: pytest.fail("the step-by-step Medusa step ran"))
    fresh_calls = []
    one_call = medusa_decode.MedusaProposer.one_call

    def spy(self, v, limit):
        fresh_calls.append(self.fresh)
        return one_call(self, v, limit)

    monkeypatch.setattr(medusa_decode.MedusaProposer, "one_call", spy)
    rng = random.Random(3)
    estimates = AutoEstimates()
    for i in range(30):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))]
        max_new = rng.randint(1, 50)
        plain, _ = generate_ar(runner, torch.tensor([prompt]), sampling=GREEDY, generator=make_generator(0),
                               max_new_tokens=max_new)
        eos = plain[rng.randrange(len(plain))] if i % 3 == 0 else None
        want, _ = generate_ar(runner, torch.tensor([prompt]), sampling=GREEDY, generator=make_generator(0),
                              max_new_tokens=max_new, eos_token_id=eos)
        got, stats = generate_auto(runner, torch.tensor([prompt]), draft=None, heads=heads, sampling=GREEDY,
                                   generator=make_generator(0), max_new_tokens=max_new, estimates=estimates,
                                   eos_token_id=eos)
        assert got == want, (i, prompt, max_new, eos)
        assert all(c <= p for c, p in zip(stats.head_correct, stats.head_predictions))
    assert counter.calls == len(fresh_calls) > 30 and any(fresh_calls) and not all(fresh_calls)
