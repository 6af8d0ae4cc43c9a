"""Greedy exactness: draft and ngram == ar == transformers, token for token.

900 random prompts (random lengths 1-40, random or repetitive contents, max_new_tokens
1-14 or, for 15% of them, 15-32; EOS on a third of them) over five architectures and
both runner implementations, 150 prompts per model pair: Llama on the fast runner
with a perturbed-copy draft and on the transformers runner with a GPT-2 draft
(cross-architecture, same vocabulary), Qwen2 and Mistral on the fast runner, GPT-2 and
GPT-NeoX on the transformers runner. Every (γ, schedule) pair of 6 γ × 3 schedules
is used on every model (at least 8 prompts each). The plain reference is checked
against transformers on every prompt with one batched full-sequence forward (each
emitted token is the argmax of transformers' own logits, the output stops exactly at
the first EOS or at the budget) and against transformers' ``generate`` on every
eighth prompt. All seeds are fixed.
"""

from __future__ import annotations

import itertools
import random

import pytest

from specops.decoder import Decoder
from tests.decoder.tiny_models import (
    VOCAB,
    hf_greedy,
    perturbed,
    tiny_gpt2,
    tiny_llama,
    tiny_other,
    transformers_greedy_violations,
)

GAMMAS = (1, 2, 3, 4, 6, 8)
SCHEDULES = ("constant", "heuristic", "goodput")
PAIRS = tuple(itertools.product(GAMMAS, SCHEDULES))  # 18 (γ, schedule) pairs, decoupled
GENERATE_EVERY = 8  # transformers' generate itself on every 8th prompt


def random_prompt(rng: random.Random) -> list[int]:
    length = rng.randint(1, 40)
    if rng.random() < 0.5:
        return [rng.randrange(VOCAB) for _ in range(length)]
    motif = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]  # repetitive text: lookup hits
    out = []
    while len(out) < length:
        out.extend(motif if rng.random() < 0.8 else [rng.randrange(VOCAB)])
    return out[:length]


def random_budget(rng: random.Random) -> int:
    return rng.randint(15, 32) if rng.random() < 0.15 else rng.randint(1, 14)


def _pair(name: str):
    """(target, draft, runner impl) for one configuration."""
    if name == "llama-fast":
        target = tiny_llama(seed=10)
        return target, perturbed(target, noise=0.05, seed=11), "fast"
    if name == "llama-hf+gpt2-draft":
        return tiny_llama(seed=12), tiny_gpt2(seed=13), "hf"
    if name == "gpt2-hf":
        target = tiny_gpt2(seed=14)
        return target, perturbed(target, noise=0.05, seed=15), "hf"
    arch, impl = name.rsplit("-", 1)
    target = tiny_other(arch, seed=40 + len(arch))
    return target, perturbed(target, noise=0.05, seed=41), impl


CONFIGS = [("llama-fast", 150), ("llama-hf+gpt2-draft", 150), ("gpt2-hf", 150), ("qwen2-fast", 150),
           ("mistral-fast", 150), ("gpt_neox-hf", 150)]


@pytest.mark.parametrize("name, prompts", CONFIGS)
def test_speculative_greedy_equals_ar_and_transformers(name, prompts):
    target, draft, impl = _pair(name)
    dec = Decoder(target, draft=draft, impl=impl)
    assert type(dec.target).__name__ == ("FastLlamaRunner" if impl == "fast" else "HFRunner")
    rng = random.Random(f"exactness-{name}")  # str seeds are deterministic across runs
    mismatches = []
    cases = []
    totals = {"draft": [0, 0], "ngram": [0, 0]}
    seen = {"eos_stops": 0, "long": 0, "generate": 0}
    pairs_used = set()
    for i in range(prompts):
        prompt, n = random_prompt(rng), random_budget(rng)
        ar = dec.generate(prompt, method="ar", max_new_tokens=n).tokens
        eos = None
        if rng.random() < 1 / 3:
            eos = ar[rng.randrange(len(ar))]
            ar = dec.generate(prompt, method="ar", max_new_tokens=n, eos_token_id=eos).tokens
            seen["eos_stops"] += len(ar) < n
        seen["long"] += n >= 15
        cases.append((prompt, ar, eos, n))
        if i % GENERATE_EVERY == 0:
            seen["generate"] += 1
            if hf_greedy(target, prompt, n, eos_token_id=eos) != ar:
                mismatches.append(("generate", prompt, n, eos, ar))
        gamma, schedule = PAIRS[i % len(PAIRS)]
        pairs_used.add((gamma, schedule))
        for method in ("draft", "ngram"):
            out = dec.generate(prompt, method=method, gamma=gamma, schedule=schedule, gamma_max=8,
                               max_new_tokens=n, eos_token_id=eos)
            totals[method][0] += out.stats.accepted
            totals[method][1] += out.stats.drafted
            if out.tokens != ar:
                mismatches.append((method, gamma, schedule, prompt, n, eos, out.tokens, ar))
    mismatches += [("transformers", *case) for case in transformers_greedy_violations(target, cases)]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]}"
    # the sweep covered what it claims, and the drafters really drafted and were accepted
    assert pairs_used == set(PAIRS)
    assert seen["eos_stops"] >= prompts // 10 and seen["long"] >= prompts // 10 and seen["generate"] >= 18, seen
    assert totals["ngram"][1] > prompts and totals["ngram"][0] > 0
    assert totals["draft"][1] > prompts
    if name != "llama-hf+gpt2-draft":  # a perturbed copy agrees with its target far above chance (1/96)
        assert totals["draft"][0] / totals["draft"][1] > 0.3, totals


def test_the_transformers_check_catches_a_wrong_token_and_a_missed_stop():
    """The batched reference check has the power to fail."""
    model = tiny_llama(seed=10)
    prompt = [3, 1, 4, 1, 5]
    good = hf_greedy(model, prompt, 6)
    assert transformers_greedy_violations(model, [(prompt, good, None, 6)]) == []
    wrong = good[:3] + [(good[3] + 1) % VOCAB] + good[4:]
    assert len(transformers_greedy_violations(model, [(prompt, wrong, None, 6)])) == 1
    assert len(transformers_greedy_violations(model, [(prompt, good[:5], None, 6)])) == 1  # stopped early
    assert len(transformers_greedy_violations(model, [(prompt, good, good[2], 6)])) == int(good[2] not in good[:2])


def _bundled_prompts(tokenizer, rng: random.Random) -> list[list[int]]:
    """Held-out stdlib code (never trained on) plus random token soup."""
    prompts: list[list[int]] = []
    from specops.train.data import code_prompts, split_stdlib

    heldout = split_stdlib().heldout_files
    if heldout:
        prompts += [tokenizer.encode(text)[-120:] for text in code_prompts(heldout, count=10, max_chars=400, seed=3)]
    while len(prompts) < 20:
        prompts.append([rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 60))])
    return prompts


def test_bundled_pair_is_exact():
    """The shipped target + draft: draft and ngram == ar == transformers generate."""
    dec = Decoder.from_pretrained("bundled")
    assert dec.draft is not None and dec.target_model is not None
    rng = random.Random("bundled")
    accepted = drafted = 0
    for i, prompt in enumerate(_bundled_prompts(dec.tokenizer, rng)):
        ref = hf_greedy(dec.target_model, prompt, 24)
        assert dec.generate(prompt, method="ar", max_new_tokens=24).tokens == ref, i
        for method, gamma, schedule in (("draft", 4, "constant"), ("draft", 3, "goodput"), ("ngram", 4, "heuristic")):
            out = dec.generate(prompt, method=method, gamma=gamma, schedule=schedule, max_new_tokens=24)
            assert out.tokens == ref, (i, method, gamma, schedule)
            if method == "draft":
                accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
    assert accepted / drafted > 0.3  # a distilled draft agrees with its target far above chance
