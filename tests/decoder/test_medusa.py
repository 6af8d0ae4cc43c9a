"""Greedy Medusa decoding equals plain greedy decoding and transformers, token for token.

1200 random prompts over small random models of five architectures, at least 150 each
(Llama, Qwen2 and Mistral through FastLlamaRunner; Llama, GPT-2 and GPT-NeoX through
the generic HFRunner); the plain reference is checked against transformers on every
prompt (one batched full-sequence forward: each token is transformers' argmax and the
output stops at the first EOS, the budget or the context) and against transformers'
``generate`` on every eighth prompt. Heads
that are random, untrained (LM-head copies), quickly self-distilled (so long paths are
accepted) or sharing the LM head, every tree preset plus the cost-planned tree, 1..4
heads, random budgets, EOS ids and small context windows (so EOS inside an accepted
path, the budget landing mid-path and a full context all occur).
"""

from __future__ import annotations

import random

import pytest
import torch

from specops.spec.autoregressive import generate_ar
from specops.models.fast_llama import FastLlamaRunner
from specops.models.hf_runner import HFRunner
from specops.spec.medusa_decode import generate_medusa
from specops.models.medusa_heads import MedusaHeads
from specops.spec.sampling import SamplingConfig, make_generator
from specops.spec.tree import PRESETS
from specops.train.heads import HeadsTrainConfig, train_heads
from tests.decoder.medusa_models import one_thread, tiny_model  # noqa: F401 (fixture)
from tests.decoder.tiny_models import hf_greedy, transformers_greedy_violations

GREEDY = SamplingConfig()
VOCAB = 48


def distilled_heads(model, num_heads: int, seed: int, shared: bool = False) -> MedusaHeads:
    """Heads self-distilled for a few steps: random tiny models loop, so heads learn them fast."""
    heads = MedusaHeads.from_model(model, num_heads=num_heads, shared_lm_head=shared)
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCAB, (2000,), generator=gen)
    heldout = torch.randint(0, VOCAB, (4, 40), generator=gen)
    cfg = HeadsTrainConfig(num_heads=num_heads, steps=40, seq_len=40, batch_size=8, distill_prompt_len=6,
                           distill_sequences=32, self_distill=True, lr=1e-2, progress=False, eval_batches=1,
                           shared_lm_head=shared, seed=seed)
    train_heads(model, heads, stream, heldout, cfg)
    return heads


def random_heads(model, num_heads: int, seed: int) -> MedusaHeads:
    heads = MedusaHeads.from_model(model, num_heads=num_heads)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return heads


# name -> (arch, runner, heads kind, K, prompts, context)
CASES = {
    "llama-fast-distilled": ("llama", "fast", "distilled", 3, 260, 96),
    "llama-fast-distilled-4": ("llama", "fast", "distilled", 4, 140, 30),
    "qwen2-fast-shared-head": ("qwen2", "fast", "shared", 2, 150, 96),
    "llama-hf-random": ("llama", "hf", "random", 2, 110, 96),
    "gpt2-hf-distilled": ("gpt2", "hf", "distilled", 3, 140, 96),
    "gpt_neox-hf-untrained": ("gpt_neox", "hf", "untrained", 1, 150, 32),
    "mistral-fast-distilled": ("mistral", "fast", "distilled", 3, 150, 96),
    "gpt2-hf-random-4": ("gpt2", "hf", "random", 4, 100, 30),
}


def make_case(name: str):
    arch, kind, heads_kind, k, prompts, context = CASES[name]
    seed = sum(map(ord, name))
    model = tiny_model(arch, vocab=VOCAB, seed=seed, context=context)
    if heads_kind == "distilled":
        heads = distilled_heads(model, k, seed)
    elif heads_kind == "shared":
        heads = distilled_heads(model, k, seed, shared=True)
    elif heads_kind == "random":
        heads = random_heads(model, k, seed)
    else:
        heads = MedusaHeads.from_model(model, num_heads=k)
    runner = FastLlamaRunner(model) if kind == "fast" else HFRunner(model)
    return runner, heads, prompts, model


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_medusa_equals_ar(name, one_thread):
    runner, heads, prompts, model = make_case(name)
    context = CASES[name][5]
    rng = random.Random(name)
    cases, generate_mismatches = [], []
    trees = [*PRESETS, None]
    totals = {"accepted": 0, "forwards": 0, "tokens": 0, "eos_cut": 0, "context": 0, "deep": 0}
    for i in range(prompts):
        prompt = torch.tensor([[rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]])
        max_new = rng.randint(1, 28)
        eos = rng.randrange(VOCAB) if rng.random() < 0.3 else None
        num_heads = rng.randint(1, heads.num_heads)
        tree = trees[i % len(trees)]
        want, _ = generate_ar(runner, prompt, sampling=GREEDY, generator=make_generator(0), max_new_tokens=max_new,
                              eos_token_id=eos)
        got, stats = generate_medusa(runner, prompt, heads=heads, sampling=GREEDY, generator=make_generator(0),
                                     max_new_tokens=max_new, eos_token_id=eos, num_heads=num_heads, tree=tree)
        assert got == want, f"prompt {i}: tree={tree} heads={num_heads} max_new={max_new} eos={eos}"
        budget = min(max_new, context - prompt.shape[1])  # the context window may end it first
        cases.append((prompt[0].tolist(), want, eos, budget))
        if i % 8 == 0 and hf_greedy(model, prompt[0].tolist(), budget, eos_token_id=eos) != want:
            generate_mismatches.append((i, prompt[0].tolist(), budget, eos, want))
        # stats invariants
        assert stats.new_tokens == len(got) == len(stats.token_latencies_s)
        # the prompt but its last token in one forward (none for a one-token prompt), then the steps
        assert stats.target_forwards == stats.steps + (prompt.shape[1] > 1)
        assert stats.accepted == sum(stats.accepted_per_pos) <= stats.drafted == sum(stats.drafted_per_pos)
        # every step emits accepted + 1 tokens, except a last step cut at an accepted EOS
        missing = stats.steps + stats.accepted - stats.new_tokens
        assert missing == 0 or (missing == 1 and stats.stop_reason == "eos")
        assert all(c <= p for c, p in zip(stats.head_correct, stats.head_predictions))
        assert len(stats.head_predictions) == num_heads
        totals["accepted"] += stats.accepted
        totals["forwards"] += stats.target_forwards
        totals["tokens"] += stats.new_tokens
        totals["eos_cut"] += stats.stop_reason == "eos"
        totals["context"] += stats.stop_reason == "context"
        totals["deep"] += any(a > 0 for a in stats.accepted_per_pos[1:])
    assert not generate_mismatches, generate_mismatches[:3]
    assert transformers_greedy_violations(model, cases) == []
    assert totals["accepted"] > 0
    if CASES[name][2] in ("distilled", "shared"):
        # trained heads must make the test exercise long accepted paths
        assert totals["tokens"] / totals["forwards"] > (1.5 if CASES[name][2] == "distilled" else 1.25), totals
        assert totals["deep"] > prompts // 10, totals
    if CASES[name][5] <= 48:
        assert totals["context"] > 0, totals


def test_eos_inside_accepted_path_is_cut(one_thread):
    """A greedy model that loops: pick an EOS the tree is certain to accept mid-path."""
    runner, heads, _, _ = make_case("llama-fast-distilled")
    prompt = torch.tensor([[3, 7, 1]])
    want, _ = generate_ar(runner, prompt, sampling=GREEDY, generator=make_generator(0), max_new_tokens=30)
    cut_seen = False
    for eos in sorted(set(want)):
        ar, _ = generate_ar(runner, prompt, sampling=GREEDY, generator=make_generator(0), max_new_tokens=30,
                            eos_token_id=eos)
        got, stats = generate_medusa(runner, prompt, heads=heads, sampling=GREEDY, generator=make_generator(0),
                                     max_new_tokens=30, eos_token_id=eos, tree="large")
        assert got == ar and got[-1] == eos and stats.stop_reason == "eos"
        cut_seen |= stats.accepted > 0
    assert cut_seen


def test_bad_requests_raise(one_thread):
    from specops.spec.errors import InvalidRequestError

    runner, heads, _, _ = make_case("gpt_neox-hf-untrained")
    prompt = torch.tensor([[1, 2]])
    kwargs = dict(sampling=GREEDY, generator=make_generator(0), max_new_tokens=4)
    with pytest.raises(InvalidRequestError, match="heads must be in 1..1"):
        generate_medusa(runner, prompt, heads=heads, num_heads=2, **kwargs)
    with pytest.raises(InvalidRequestError, match="unknown tree preset"):
        generate_medusa(runner, prompt, heads=heads, tree="bushy", **kwargs)
    with pytest.raises(InvalidRequestError, match="2 deep"):
        generate_medusa(runner, prompt, heads=heads, tree=[(0,), (0, 0)], **kwargs)
    with pytest.raises(InvalidRequestError, match="typical acceptance"):
        generate_medusa(runner, prompt, heads=heads, typical=True, **kwargs)
    with pytest.raises(InvalidRequestError, match="no room"):
        generate_medusa(runner, torch.zeros(1, 32, dtype=torch.long), heads=heads, **kwargs)
