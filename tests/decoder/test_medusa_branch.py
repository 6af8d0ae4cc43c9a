"""The prompt-lookup branch of a Medusa step (`specops.spec.medusa_branch`): its trie merge
into the heads' tree against a brute-force construction, and the library's step-by-step greedy
loop taking the same branch as the one-call C step (same tokens, statistics and cache bits)."""

from __future__ import annotations

import random

import pytest
import torch

import specops.spec.medusa_decode as medusa_decode
from specops.spec.autoregressive import generate_ar
from specops.models.fast_llama import FastLlamaRunner, MedusaSteps
from specops.spec.medusa_branch import branch_accepted, branch_tokens, context_index, merge_branch
from specops.spec.medusa_decode import generate_medusa
from specops.spec.sampling import SamplingConfig, make_generator
from specops.spec.tree import build_buffers, make_spec, preset
from specops.spec.tree_verify import verify_tree_greedy
from specops.kernels import cpu_linear
from tests.decoder.medusa_models import tiny_model
from tests.decoder.test_medusa import distilled_heads
from tests.decoder.test_tree import random_tree

GREEDY = SamplingConfig()
VOCAB = 48


def token_paths(tokens: list[int], parent: list[int]) -> list[tuple[int, ...]]:
    """Each node's tokens after the root, root first (the root's is empty)."""
    out: list[tuple[int, ...]] = []
    for i, p in enumerate(parent):
        out.append(() if p < 0 else out[p] + (tokens[i],))
    return out


@pytest.mark.parametrize("seed", range(150))
def test_a_merged_branch_is_the_trie_of_the_tree_and_the_branch(seed):
    rng = random.Random(seed)
    spec = make_spec(random_tree(rng, 14, 4, 3))
    buffers = build_buffers(spec)
    # a head's candidates differ from each other: rank r at depth d carries token 10 d + r
    tokens = torch.tensor([1] + [10 * len(p) + p[-1] for p in spec.paths])
    before = token_paths(tokens.tolist(), buffers.parent.tolist())
    walk = [rng.choice([10 * d, 10 * d + 1, 99]) for d in range(1, rng.randint(0, 7) + 1)]  # often along the tree
    merged_tokens, merged = merge_branch(tokens, buffers, walk)
    n, m = buffers.num_nodes, merged.num_nodes
    toks, parent = merged_tokens.tolist(), merged.parent.tolist()
    paths = token_paths(toks, parent)
    assert paths[:n] == before and toks[:n] == tokens.tolist()  # the tree's nodes keep their place
    want = set(before) | {tuple(walk[:k]) for k in range(len(walk) + 1)}
    assert len(paths) == len(set(paths)) and set(paths) == want  # a trie: each token path once
    assert m == n + merged.appended and len(toks) == m
    if m == n:
        assert merged is buffers and merged_tokens is tokens
    assert merged.depth.tolist() == [len(p) for p in paths]
    assert all(parent[i] < i for i in range(1, m))  # parents come first: the path is increasing
    mask = [[paths[i][: len(paths[j])] == paths[j] for j in range(m)] for i in range(m)]
    assert merged.attn_mask.tolist() == mask
    assert merged.children == tuple(tuple(c for c in range(m) if parent[c] == i) for i in range(m))
    chains = {}
    for i in range(m):
        chains[i] = (chains[parent[i]] if parent[i] >= 0 else ()) + (i,)
    leaves = [i for i in range(m) if i not in parent]
    rows = [tuple(r for r in row if r >= 0) for row in merged.retrieve.tolist()]
    assert sorted(rows) == sorted(chains[i] for i in leaves)
    # the greedy walk takes the longest path the target agrees with, the branch's or the heads'
    target = walk + [5] * 8 if rng.random() < 0.5 else list(before[-1]) + [5] * 8
    choice = []
    for path in paths:
        depth = len(path)
        choice.append(target[depth] if path == tuple(target[:depth]) else 7)
    verdict = verify_tree_greedy(merged_tokens, torch.zeros(m, 1), merged, choice)
    accepted = [toks[i] for i in verdict.path[1:]]
    longest = max((p for p in paths if p == tuple(target[: len(p)])), key=len)
    assert tuple(accepted) == longest
    assert branch_accepted(walk, accepted) == next((k for k in range(len(walk)) if walk[k] != target[k]), len(walk))


def test_an_empty_branch_or_one_along_the_tree_adds_nothing():
    spec = preset("chain", 3)
    buffers = build_buffers(spec)
    tokens = torch.tensor([4, 5, 6, 7])
    for branch in (None, [], [5], [5, 6, 7]):
        got_tokens, got = merge_branch(tokens, buffers, branch)
        assert got is buffers and got_tokens is tokens
    got_tokens, got = merge_branch(tokens, buffers, [5, 6, 8, 9])
    assert got_tokens.tolist() == [4, 5, 6, 7, 8, 9] and got.parent.tolist() == [-1, 0, 1, 2, 2, 4]
    assert got.num_nodes == 6 and got.appended == 2 and got.spec is spec


def test_a_branch_follows_only_full_length_matches_within_its_caps():
    index = context_index([1, 2, 3, 4, 5, 6, 9, 1, 2, 3])  # [1, 2, 3] occurred: 4, 5, 6 ... followed it
    assert branch_tokens(index, 4, drafts=10, space=10) == [4, 5, 6, 9]
    assert branch_tokens(index, 4, drafts=2, space=10) == [4, 5]
    assert branch_tokens(index, 4, drafts=10, space=3) == [4, 5, 6]
    assert branch_tokens(index, 4, drafts=0, space=10) is None
    assert branch_tokens(index, 0, drafts=10, space=10) is None
    assert branch_tokens(None, 4, drafts=10, space=10) is None
    assert branch_tokens(context_index([1, 2, 3, 4, 2, 3]), 4, drafts=10, space=10) is None  # a 2-token match
    long = list(range(20, 36))
    assert len(branch_tokens(context_index(long + [0] * 40 + long), 4, drafts=40, space=40)) == 12  # 16 back: 3x


@pytest.fixture(scope="module")
def case():
    assert cpu_linear.available(), cpu_linear.unavailable_reason()  # CI builds the kernels: never a skip
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_model("qwen2", vocab=VOCAB, seed=11, context=64)
    heads = distilled_heads(model, 3, 11, shared=True)
    yield FastLlamaRunner(model), heads
    torch.set_num_threads(before)


def run(runner, heads, prompt, **kwargs):
    tokens, stats = generate_medusa(runner, torch.tensor([prompt]), heads=heads, sampling=GREEDY,
                                    generator=make_generator(0), **kwargs)
    cache = runner.cache.data[:, :, :, :, : runner.cache.length].clone()
    return tokens, stats, cache


def test_the_step_by_step_loop_takes_the_branch_the_c_steps_take(case, monkeypatch):
    """Greedy Medusa with the branch on the fast runner's one-call steps and step by step (the
    path of runners and heads without them): the same tokens as plain decoding, the same
    statistics and the same cache bits, for fixed trees, EOS, budgets and the context's end."""
    runner, heads = case
    c_branches = python_branches = 0
    step, merge = MedusaSteps.step, medusa_decode.merge_branch

    def counted_step(steps, tree, root, branch=None):
        nonlocal c_branches
        c_branches += bool(branch)
        return step(steps, tree, root, branch)

    def counted_merge(tokens, buffers, branch):
        nonlocal python_branches
        python_branches += bool(branch)
        return merge(tokens, buffers, branch)

    monkeypatch.setattr(MedusaSteps, "step", counted_step)
    monkeypatch.setattr(medusa_decode, "merge_branch", counted_merge)
    rng = random.Random(21)
    trees = ["chain", "small", [(0,), (1,), (0, 0)], "medium"]
    stops = set()
    for i in range(32):
        unit = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        prompt = (unit * 4)[: rng.randint(8, 20)]  # repeats: full 3-gram matches from the first step
        kwargs = dict(max_new_tokens=rng.randint(20, 60), tree=trees[i % len(trees)], eos_token_id=None,
                      lookup_branch=(4, 8)[i % 2])
        ar, _ = generate_ar(runner, torch.tensor([prompt]), sampling=GREEDY, generator=make_generator(0),
                            max_new_tokens=kwargs["max_new_tokens"])
        if i % 5 == 0:
            kwargs["eos_token_id"] = ar[rng.randrange(len(ar))]
            ar = ar[: ar.index(kwargs["eos_token_id"]) + 1]
        got, stats, cache = run(runner, heads, prompt, **kwargs)
        with monkeypatch.context() as m:
            m.setattr(medusa_decode, "c_steps", lambda *args, **kw: None)
            want, want_stats, want_cache = run(runner, heads, prompt, **kwargs)
        assert got == want == ar, (i, kwargs)
        for field in ("target_forwards", "drafted_per_pos", "accepted_per_pos", "head_predictions", "head_correct",
                      "stop_reason"):
            assert getattr(stats, field) == getattr(want_stats, field), (i, field)
        assert torch.equal(cache, want_cache), f"prompt {i}: the caches differ"
        stops.add(stats.stop_reason)
    assert python_branches == c_branches >= 32, (python_branches, c_branches)
    assert stops == {"eos", "max_new_tokens", "context"}, stops
