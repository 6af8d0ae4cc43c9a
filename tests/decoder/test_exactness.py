"""Greedy exactness: draft and ngram == ar == transformers' generate, token for token.

1000 random prompts (random lengths 1-40, random or repetitive contents, random
max_new_tokens 1-14, EOS on a third of them) over two architectures and both runner
implementations: a Llama target on the fast runner with a perturbed-copy draft, a
Llama target on the transformers runner with a GPT-2 draft (cross-architecture, same
vocabulary), and a GPT-2 target with a GPT-2 draft. γ cycles over 1-8 and every γ
schedule is used. All seeds are fixed.
"""

from __future__ import annotations

import random

import pytest

from specops.decoder import Decoder
from tests.decoder.tiny_models import VOCAB, hf_greedy, perturbed, tiny_gpt2, tiny_llama, tiny_other

GAMMAS = (1, 2, 3, 4, 6, 8)
SCHEDULES = ("constant", "heuristic", "goodput")


def random_prompt(rng: random.Random) -> list[int]:
    length = rng.randint(1, 40)
    if rng.random() < 0.5:
        return [rng.randrange(VOCAB) for _ in range(length)]
    motif = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]  # repetitive text: lookup hits
    out = []
    while len(out) < length:
        out.extend(motif if rng.random() < 0.8 else [rng.randrange(VOCAB)])
    return out[:length]


def _pair(name: str):
    if name == "llama-fast":
        target = tiny_llama(seed=10)
        return target, perturbed(target, noise=0.05, seed=11), "fast"
    if name == "llama-hf+gpt2-draft":
        return tiny_llama(seed=12), tiny_gpt2(seed=13), "hf"
    target = tiny_gpt2(seed=14)
    return target, perturbed(target, noise=0.05, seed=15), "hf"


@pytest.mark.parametrize("name, prompts", [("llama-fast", 450), ("llama-hf+gpt2-draft", 150), ("gpt2-hf", 400)])
def test_speculative_greedy_equals_ar_and_transformers_generate(name, prompts):
    target, draft, impl = _pair(name)
    dec = Decoder(target, draft=draft, impl=impl)
    rng = random.Random(f"exactness-{name}")  # str seeds are deterministic across runs
    mismatches = []
    totals = {"draft": [0, 0], "ngram": [0, 0]}
    eos_checked_with_hf = 0
    for i in range(prompts):
        prompt = random_prompt(rng)
        n = rng.randint(1, 14)
        ref = hf_greedy(target, prompt, n)
        eos = None
        if rng.random() < 1 / 3:
            eos = ref[rng.randrange(len(ref))]
            ref = ref[: ref.index(eos) + 1]  # greedy decoding stopped at the first EOS
            if eos_checked_with_hf < 30:  # the cut reference is what transformers itself does
                assert hf_greedy(target, prompt, n, eos_token_id=eos) == ref
                eos_checked_with_hf += 1
        gamma, schedule = GAMMAS[i % len(GAMMAS)], SCHEDULES[(i // len(GAMMAS)) % len(SCHEDULES)]
        ar = dec.generate(prompt, method="ar", max_new_tokens=n, eos_token_id=eos).tokens
        if ar != ref:
            mismatches.append(("ar", prompt, n, eos, ar, ref))
        for method in ("draft", "ngram"):
            out = dec.generate(prompt, method=method, gamma=gamma, schedule=schedule, gamma_max=8,
                               max_new_tokens=n, eos_token_id=eos)
            totals[method][0] += out.stats.accepted
            totals[method][1] += out.stats.drafted
            if out.tokens != ref:
                mismatches.append((method, gamma, schedule, prompt, n, eos, out.tokens, ref))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]}"
    # the drafters really drafted and were really accepted (the test is not vacuous)
    assert totals["ngram"][1] > prompts and totals["ngram"][0] > 0
    assert totals["draft"][1] > prompts
    if name != "llama-hf+gpt2-draft":  # a perturbed copy agrees with its target most of the time
        assert totals["draft"][0] / totals["draft"][1] > 0.4, totals


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gpt_neox"])
def test_more_architectures_are_exact(arch):
    """Beyond the 1000 prompts above: Qwen2 / Mistral (fast path) and GPT-NeoX (generic path)."""
    target = tiny_other(arch, seed=40)
    dec = Decoder(target, draft=perturbed(target, noise=0.05, seed=41))
    rng = random.Random(f"arch-{arch}")
    for i in range(30):
        prompt, n = random_prompt(rng), rng.randint(1, 12)
        ref = hf_greedy(target, prompt, n)
        for method in ("ar", "draft", "ngram"):
            out = dec.generate(prompt, method=method, gamma=GAMMAS[i % len(GAMMAS)],
                               schedule=SCHEDULES[i % len(SCHEDULES)], max_new_tokens=n)
            assert out.tokens == ref, (arch, method, prompt, n)


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
