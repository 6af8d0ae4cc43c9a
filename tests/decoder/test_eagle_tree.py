"""EAGLE-2's dynamic draft tree (`specops.spec.eagle_tree`) behind ``eagle_tree=``.

Greedy output equals plain decoding token for token on the fast and the transformers runner
(held-out code prompts and random ones, several tree shapes, the context's end); a drafter that
ranks tokens as the target does is accepted to the tree's full depth; every kept node set is a
tree within the shape; the expansion keeps the best frontier and the best nodes by value (and
reports the drafter's estimates of the shape's best nodes, whatever the tree keeps), and
every node is drafted as a chain along its path would draft it (the drafter's tree mask and
positions); EOS, ``max_new_tokens`` and the deadline behave as with the chain; sampled requests
keep the chain; bad settings get clear errors. The trained drafter is test_eagle's.
"""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from specops.decoder import Decoder, InvalidRequestError
from specops.spec import eagle_tree
from specops.models.eagle_model import EagleDrafter
from specops.models.eagle_io import drafter_from_state
from specops.spec.eagle_tree import EagleTree, draft_tree, keep_best
from specops.spec.step import DraftTree
from specops.models.hf_runner import HFRunner
from tests.decoder.test_eagle import bundled_setup, spy_eos_cuts
from tests.decoder.test_eagle3 import bigram_target, draft_ids_of, eagle3_checkpoint
from tests.decoder.test_eagle3 import copying_drafter as eagle3_copying_drafter
from tests.decoder.tiny_models import tiny_llama

IMPLS = ("fast", "hf")


@pytest.fixture(scope="module")
def bundled():
    return bundled_setup()


@pytest.fixture(scope="module")
def decoders(bundled):
    model, tok, _, _, drafter = bundled
    return {impl: Decoder(model, eagle=drafter, tokenizer=tok, impl=impl) for impl in IMPLS}


def collect_trees(monkeypatch) -> list[tuple[DraftTree, EagleTree, int]]:
    """Every tree drafted from here on: (the tree, its shape, the depth and size it was allowed)."""
    trees = []
    real = eagle_tree.draft_tree

    def spy(drafter, last, root, shape, depth, size, device, cache=None, estimates=None):
        tree, forwards = real(drafter, last, root, shape, depth, size, device, cache, estimates)
        trees.append((tree, shape, depth, size))
        return tree, forwards

    monkeypatch.setattr(eagle_tree, "draft_tree", spy)
    return trees


# ---------------------------------------------------------------------- exactness
@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_tree_equals_plain_decoding_on_code_and_random_prompts(bundled, decoders, impl):
    dec = decoders[impl]
    rng = random.Random(3)
    code = bundled[3][:2]
    prompts = code + [[rng.randrange(4096) for _ in range(n)] for n in (12, 30)]
    accepted = 0
    for i, prompt in enumerate(prompts):
        ref = dec.generate(prompt, method="ar", max_new_tokens=40).tokens
        for shape in ((1, 1, 2), (4, 2, 8), (6, 4, 20)):
            out = dec.generate(prompt, method="eagle", max_new_tokens=40, eagle_tree=shape)
            assert out.tokens == ref, (i, shape)
            s = out.stats
            assert s.method == "eagle" and s.new_tokens == 40 and s.accepted <= s.drafted
            assert max(s.gamma_trace) <= shape[0] and s.target_forwards == s.steps + 1
            accepted += s.accepted if i < len(code) else 0
    assert accepted > 60, "the trained drafter must have drafts accepted for this test to mean anything"


def test_a_tree_one_node_wide_is_the_chain(bundled, decoders):
    """topk 1 drafts the chain's tokens: the same steps, drafts and acceptances as γ = depth."""
    dec = decoders["fast"]
    for prompt in bundled[3][:2]:
        chain = dec.generate(prompt, method="eagle", gamma=4, max_new_tokens=40).stats
        tree = dec.generate(prompt, method="eagle", max_new_tokens=40, eagle_tree=(4, 1, 5)).stats
        assert (tree.gamma_trace, tree.accepted_per_pos) == (chain.gamma_trace, chain.accepted_per_pos)
        assert tree.draft_forwards == chain.draft_forwards


def copying_drafter(model, sharpness: float = 100.0) -> EagleDrafter:
    """An EAGLE-1 drafter for `bigram_target` whose prediction at an entry is ``sharpness`` x the
    embedding of the token the entry reads (``fc`` passes it on, attention and MLP add nothing).
    The target's last hidden state at a token is that embedding scaled (its layers add nothing,
    every embedding has one norm, the final norm's weight is 1), so through the target's LM head
    the drafter ranks tokens as the target does after that token, confidently."""
    drafter = EagleDrafter.for_target(model, seed=1, input_layernorm=False)
    e = model.config.hidden_size
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, :e] = sharpness * torch.eye(e)
        drafter.fc.bias.zero_()
        drafter.layers[0].self_attn.o_proj.weight.zero_()
        drafter.layers[0].mlp.down_proj.weight.zero_()
    return drafter.eval()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_drafter_that_ranks_as_the_target_does_is_accepted_to_full_depth(impl):
    model = bigram_target(seed=0)
    dec = Decoder(model, eagle=copying_drafter(model), impl=impl)
    prompt = [5, 17, 33, 8]
    ref = dec.generate(prompt, method="ar", max_new_tokens=42).tokens
    out = dec.generate(prompt, method="eagle", max_new_tokens=42, eagle_tree=(6, 3, 12))
    assert out.tokens == ref
    s = out.stats
    assert s.gamma_trace == [6] * 6 and s.accepted == s.drafted == 36  # 7 tokens per verifying forward
    assert s.target_forwards == 7
    assert s.draft_forwards == 1 + 6 * 5 + 5  # the prompt, 5 expansions per step, the feeds but the last


def test_an_eagle3_drafter_drafts_trees_through_the_transformers_runner():
    """The tree forward returns the fused layers' hidden states along the accepted path too."""
    model = bigram_target(seed=0)
    vocab = model.config.vocab_size
    prompts = ([5, 17, 33, 8], [11, 2, 90, 45, 45, 7, 31, 3])
    with torch.no_grad():
        choice = model(input_ids=torch.arange(vocab)[:, None]).logits[:, 0].argmax(-1).tolist()
    orbit = set()  # the tokens the greedy outputs run through: the draft vocabulary must hold them
    for prompt in prompts:
        token = prompt[-1]
        while token not in orbit:
            orbit.add(token)
            token = choice[token]
    config, state = eagle3_copying_drafter(model, sorted(orbit | set(draft_ids_of(vocab, 40))))
    dec = Decoder(model, eagle=drafter_from_state(config, state).bind(model))
    assert isinstance(dec.target, HFRunner)
    for prompt in prompts:
        ref = dec.generate(prompt, method="ar", max_new_tokens=30).tokens
        out = dec.generate(prompt, method="eagle", max_new_tokens=30, eagle_tree=(5, 2, 10))
        assert out.tokens == ref, prompt
        assert out.stats.accepted >= 0.8 * out.stats.drafted > 0


def test_the_context_end_cuts_the_tree_and_the_output_stays_exact(monkeypatch):
    """Near the end of the target's context (and the drafter's, the same 256 positions) the tree
    is cut to the positions left: no forward overflows, the output is plain decoding's."""
    model = bigram_target(seed=6)
    dec = Decoder(model, eagle=copying_drafter(model))
    trees = collect_trees(monkeypatch)
    prompt = [random.Random(1).randrange(96) for _ in range(236)]
    ref = dec.generate(prompt, method="ar", max_new_tokens=20).tokens
    out = dec.generate(prompt, method="eagle", max_new_tokens=20, eagle_tree=(6, 4, 24))
    assert out.tokens == ref and len(ref) == 20
    assert min(size for _, _, _, size in trees) < 24 and min(depth for _, _, depth, _ in trees) < 6


# ---------------------------------------------------------------------- the tree
@pytest.mark.parametrize("shape", [(3, 2, 5), (5, 4, 16), (6, 6, 32)])
def test_every_kept_node_set_is_a_tree_within_the_shape(bundled, decoders, monkeypatch, shape):
    trees = collect_trees(monkeypatch)
    for prompt in bundled[3][:2]:
        decoders["fast"].generate(prompt, method="eagle", max_new_tokens=32, eagle_tree=shape)
    assert len(trees) > 10
    depth, _, size = shape
    for tree, _, allowed_depth, allowed_size in trees:
        b = tree.buffers
        parents, toks = b.parent.tolist(), tree.tokens.tolist()
        assert b.num_nodes <= min(size, allowed_size) and tree.depth <= min(depth, allowed_depth)
        assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
        for children in b.children:
            assert len({toks[c] for c in children}) == len(children)  # siblings carry distinct tokens
    assert max(tree.buffers.num_nodes for tree, *_ in trees) == size


def test_keep_best_keeps_a_tree_of_the_highest_values():
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randrange(1, 40)
        parents, depths, values = [], [], []
        for i in range(n):
            p = rng.randrange(-1, i) if i else -1
            parents.append(p)
            depths.append(1 if p < 0 else depths[p] + 1)
            # a child never beats its parent, except in every fifth trial (the rule must hold anyway)
            step = -rng.random() if trial % 5 else rng.uniform(-1.0, 0.5)
            values.append((values[p] if p >= 0 else 0.0) + step)
        count = rng.randrange(0, n + 2)
        kept = keep_best(values, parents, depths, count)
        assert len(kept) == min(count, n) if trial % 5 else len(kept) <= count
        assert len(set(kept)) == len(kept)
        for j, i in enumerate(kept):
            assert parents[i] < 0 or parents[i] in kept[:j]
        if trial % 5:  # values never grow along a path: exactly the best `count` by value
            assert sorted(values[i] for i in kept) == sorted(values, reverse=True)[: len(kept)][::-1]


class TableDrafter:
    """A scripted drafter over ``V`` tokens: an entry's prediction is the one-hot of the token it
    reads, whose logits are that token's row of ``table``; it logs every step's positions and mask."""

    shortlist = None

    def __init__(self, table: torch.Tensor, real: int) -> None:  # table: [V, V] logits
        self.table = table
        self.cache = type("Cache", (), {"length": real, "max_len": 1 << 20})()
        self.steps: list[tuple[list[int], list[int], torch.Tensor]] = []  # (tokens, positions, mask)

    def logits(self, features: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V]
        return features @ self.table

    def step(self, tokens, features, cache, *, positions, mask):
        self.steps.append((tokens.tolist(), positions.tolist(), mask))
        cache.length += len(tokens)
        return torch.nn.functional.one_hot(tokens, self.table.shape[0]).float()


def reference_tree(table: torch.Tensor, root: int, depth: int, topk: int, size: int) -> dict[tuple[int, ...], float]:
    """EAGLE-2's tree written out plainly: {token path: value} of the kept nodes."""
    logp = torch.log_softmax(table.double(), dim=-1)
    nodes: dict[tuple[int, ...], float] = {}
    level = {(): 0.0}
    last = root
    for d in range(depth):
        children = {}
        for path, value in level.items():
            row = logp[path[-1] if path else last]
            for tok in torch.topk(row, topk).indices.tolist():
                children[path + (tok,)] = value + float(row[tok])
        nodes.update(children)
        level = dict(sorted(children.items(), key=lambda kv: -kv[1])[:topk])
    return dict(sorted(nodes.items(), key=lambda kv: (-kv[1], len(kv[0])))[: size - 1])


def test_the_expansion_keeps_the_best_frontier_and_the_best_nodes():
    v, real, root = 12, 7, 3
    for seed in range(20):
        table = torch.randn(v, v, generator=torch.Generator().manual_seed(seed)) * 2.0
        shape = EagleTree(depth=4, topk=3, tree_size=14)
        drafter = TableDrafter(table, real)
        last = torch.nn.functional.one_hot(torch.tensor(root), v).float()
        tree, forwards = draft_tree(drafter, last, 99, shape, 4, 14, torch.device("cpu"))
        assert forwards == 3 and tree.tokens[0] == 99
        toks, parents = tree.tokens.tolist(), tree.buffers.parent.tolist()

        def path(i):
            return path(parents[i]) + (toks[i],) if i else ()

        want = reference_tree(table, root, 4, 3, 14)
        assert {path(i) for i in range(1, len(toks))} == set(want), seed
        for d, (tokens, positions, mask) in enumerate(drafter.steps, start=1):  # one forward per depth
            assert positions == [real + d - 1] * len(tokens)
            assert mask.shape == (len(tokens), real + 3 * d) and mask[:, :real].all()
            assert mask[:, real:].sum(dim=1).tolist() == [d] * len(tokens)  # its ancestors and itself


def test_the_estimates_are_the_best_nodes_values_whatever_the_size_kept():
    """``estimates`` receives exp(value) of the shape's best ``tree_size - 1`` nodes, best first,
    however few nodes the tree keeps (the serving engine plans its next trees on them); the kept
    nodes are the first of them."""
    v, real, root = 12, 7, 3
    for seed in range(10):
        table = torch.randn(v, v, generator=torch.Generator().manual_seed(100 + seed)) * 2.0
        shape = EagleTree(depth=4, topk=3, tree_size=14)
        want = reference_tree(table, root, 4, 3, 14)  # best first
        last = torch.nn.functional.one_hot(torch.tensor(root), v).float()
        for size in (14, 6, 2):
            estimates: list[float] = []
            tree, _ = draft_tree(TableDrafter(table, real), last, 99, shape, 4, size, torch.device("cpu"),
                                 estimates=estimates)
            assert estimates == pytest.approx([math.exp(x) for x in want.values()], rel=1e-4), (seed, size)
            toks, parents = tree.tokens.tolist(), tree.buffers.parent.tolist()

            def path(i):
                return path(parents[i]) + (toks[i],) if i else ()

            assert {path(i) for i in range(1, len(toks))} == set(list(want)[: size - 1]), (seed, size)


def chain_rank_of(drafter, cache_len: int, last: torch.Tensor, tokens: list[int], topk: int) -> list[int]:
    """The chain's top-``topk`` after drafting ``tokens`` from ``last``, from a cache cut back to
    its real entries."""
    drafter.truncate(cache_len)
    feature = last
    for tok in tokens:
        feature = drafter.step(torch.tensor([tok]), feature[None])[0]
    top = torch.topk(torch.log_softmax(drafter.logits(feature).float(), dim=-1), topk).indices.tolist()
    return top if drafter.shortlist is None else [int(drafter.shortlist[j]) for j in top]


def _eagle1(model):
    drafter = EagleDrafter.for_target(model, seed=1, input_layernorm=True).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return drafter, torch.randn(9, model.config.hidden_size)


def _eagle3(model):
    config, state = eagle3_checkpoint(model, draft_ids_of(model.config.vocab_size, 48), scale=0.4)
    drafter = drafter_from_state(config, state).bind(model).eval()
    return drafter, torch.randn(9, 3 * model.config.hidden_size)


@pytest.mark.parametrize("make", [_eagle1, _eagle3], ids=["eagle1", "eagle3"])
def test_every_node_is_drafted_as_a_chain_along_its_path_would_draft_it(make):
    """The tree's drafter forwards (one per depth, nodes of a depth side by side, a tree mask over
    the cache) give each node the prediction the chain gives after its ancestors alone."""
    model = tiny_llama(seed=5, layers=8)
    drafter, feats = make(model)
    shape = EagleTree(depth=4, topk=3, tree_size=30)
    with torch.inference_mode():
        drafter.reset()
        last = drafter.step(torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(2)), feats)[-1]
        tree, _ = draft_tree(drafter, last, 7, shape, 4, 30, torch.device("cpu"))
        assert tree.depth == 4
        toks, parents = tree.tokens.tolist(), tree.buffers.parent.tolist()
        for i in range(1, len(toks)):
            ancestors, p = [], parents[i]
            while p > 0:
                ancestors.insert(0, toks[p])
                p = parents[p]
            rank = tree.buffers.spec.paths[i - 1][-1]
            assert chain_rank_of(drafter, 9, last, ancestors, 3)[rank] == toks[i], i


# ---------------------------------------------------------------------- request edges
def test_eos_inside_an_accepted_path_ends_the_output_exactly(bundled, decoders, monkeypatch):
    cut_inside = spy_eos_cuts(monkeypatch)
    dec = decoders["fast"]
    prompt = bundled[2][0]
    full = dec.generate(prompt, method="ar", max_new_tokens=48).tokens
    for eos in sorted(set(full[4:40])):
        ref = full[: full.index(eos) + 1]
        cut_inside.clear()
        out = dec.generate(prompt, method="eagle", max_new_tokens=48, eos_token_id=eos, eagle_tree=(5, 3, 12))
        assert out.tokens == ref and out.stats.stop_reason == "eos", eos
        if any(cut_inside):
            break
    assert any(cut_inside), "no EOS landed inside an accepted path"


def test_max_new_tokens_inside_a_tree_is_exact():
    model = bigram_target(seed=0)
    dec = Decoder(model, eagle=copying_drafter(model))
    prompt = [5, 17, 33, 8]
    full = dec.generate(prompt, method="ar", max_new_tokens=14).tokens
    for n in range(1, 15):
        out = dec.generate(prompt, method="eagle", max_new_tokens=n, eagle_tree=(6, 3, 12))
        assert out.tokens == full[:n], n
        assert out.stats.stop_reason == "max_new_tokens" and out.stats.new_tokens == n
        assert all(g <= n - 1 for g in out.stats.gamma_trace)  # a step never drafts past the budget


def test_a_deadline_passed_while_the_tree_was_drafted_runs_the_step_plainly(bundled, decoders, monkeypatch):
    dec = decoders["fast"]
    prompt = bundled[2][1]
    ref = dec.generate(prompt, method="ar", max_new_tokens=12).tokens
    real = eagle_tree.draft_tree
    trees = []

    def late(*args, **kwargs):  # the deadline passes while the first tree is drafted
        trees.append(1)
        monkeypatch.setattr(time, "perf_counter", lambda: math.inf)
        return real(*args, **kwargs)

    monkeypatch.setattr(eagle_tree, "draft_tree", late)
    out = dec.generate(prompt, method="eagle", max_new_tokens=12, deadline_s=60.0, eagle_tree=(4, 3, 10))
    assert out.tokens == ref and len(trees) == 1
    assert out.stats.fallback_reason == "deadline" and out.stats.drafted == 0


def test_sampled_requests_keep_the_chain(bundled, decoders):
    dec = decoders["fast"]
    prompt = bundled[2][2]
    kw = dict(method="eagle", max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    chain = dec.generate(prompt, **kw)
    tree = dec.generate(prompt, **kw, eagle_tree=(5, 4, 16))
    assert tree.tokens == chain.tokens and tree.stats.gamma_trace == chain.stats.gamma_trace


def test_bad_tree_settings_get_clear_errors(bundled, decoders):
    dec, prompt = decoders["fast"], bundled[2][0]
    for bad, match in (((0, 2, 4), "depth must be an integer in 1..32"), ((33, 2, 4), "depth"),
                       ((3, 0, 4), "topk must be an integer in 1..32"), ((3, 2, 1), "tree_size must be an integer >= 2"),
                       ((2, 2, 8), r"tree_size 8 exceeds the 7 nodes"), ((2.0, 2, 4), "depth"),
                       ((True, 2, 4), "depth"), ((3, 2), r"\(depth, topk, tree_size\)"), ("large", "eagle_tree must be"),
                       (True, "eagle_tree must be")):
        with pytest.raises(InvalidRequestError, match=match):
            dec.generate(prompt, method="eagle", max_new_tokens=4, eagle_tree=bad)
    with pytest.raises(InvalidRequestError, match="unknown option"):
        dec.generate(prompt, method="ar", max_new_tokens=4, eagle_tree=(3, 2, 5))
