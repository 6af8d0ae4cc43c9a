"""Lossless sampling end to end beyond the fast Llama runner: the transformers runner
(GPT-2) and a grouped-query-attention Qwen2 on the fast runner, for draft, ngram and
Medusa tree decoding, with γ of 3 and 4 under the goodput and heuristic schedules.

Same statistics as `test_distribution`: the joint distribution of the first three
tokens (64 cells on a 4-token vocabulary) against the target's exact one, Pearson's
chi-square at ALPHA = 1e-3 with fixed seeds. Each case also shows its power: the same
counts reject the (deliberately far off) draft model's distribution at ALPHA.
"""

from __future__ import annotations

import pytest
import torch

from specops.decoder import Decoder
from specops.models.medusa_heads import MedusaHeads
from specops.spec.sampling import SamplingConfig
from tests.decoder.test_distribution import ALPHA, STEPS, TINY_V, _exact_joint, chi_square_pvalue
from tests.decoder.tiny_models import perturbed, tiny_gpt2, tiny_other

PROMPT = [1, 2, 3, 1, 2]  # repeats so prompt lookup drafts something
SAMPLES = 700


def _models(name: str):
    if name == "gpt2-hf":
        target = tiny_gpt2(seed=5, vocab=TINY_V, init_range=0.3)
    else:
        target = tiny_other("qwen2", seed=6, vocab=TINY_V, init_range=0.3)
        assert target.config.num_key_value_heads < target.config.num_attention_heads  # GQA
    return target, perturbed(target, noise=0.8, seed=7)


@pytest.fixture(scope="module")
def decoders():
    built = {}
    for name, impl in (("gpt2-hf", "hf"), ("qwen2-fast", "fast")):
        target, draft = _models(name)
        dec = Decoder(target, draft=draft, medusa=MedusaHeads.from_model(target, num_heads=2), impl=impl)
        assert type(dec.target).__name__ == ("HFRunner" if impl == "hf" else "FastLlamaRunner")
        built[name] = (dec, target, draft)
    return built


CASES = [
    ("gpt2-hf", "draft", {"gamma": 3, "schedule": "goodput"}, SamplingConfig(temperature=1.0)),
    ("gpt2-hf", "ngram", {"gamma": 4, "schedule": "heuristic"}, SamplingConfig(temperature=1.0)),
    ("gpt2-hf", "medusa", {"tree": "medium"}, SamplingConfig(temperature=1.0)),
    ("qwen2-fast", "draft", {"gamma": 4, "schedule": "goodput"}, SamplingConfig(temperature=0.8, top_k=3)),
    ("qwen2-fast", "ngram", {"gamma": 3, "schedule": "goodput"}, SamplingConfig(temperature=1.0)),
    ("qwen2-fast", "medusa", {"tree": "small"}, SamplingConfig(temperature=0.9, top_p=0.9)),
]


@pytest.mark.parametrize("name, method, knobs, cfg", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_joint_distribution_matches_target(decoders, name, method, knobs, cfg):
    dec, target, draft = decoders[name]
    counts = torch.zeros(TINY_V**STEPS, dtype=torch.long)
    drafted = accepted = 0
    for seed in range(SAMPLES):
        out = dec.generate(PROMPT, method=method, max_new_tokens=STEPS, seed=seed, temperature=cfg.temperature,
                           top_k=cfg.top_k, top_p=cfg.top_p, **knobs)
        counts[int("".join(map(str, out.tokens)), TINY_V)] += 1
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    # speculation really happened: blocks were drafted and some of them accepted
    assert drafted >= SAMPLES and accepted > SAMPLES // 10, (drafted, accepted)
    assert chi_square_pvalue(counts, _exact_joint(target, PROMPT, cfg)) > ALPHA
    assert chi_square_pvalue(counts, _exact_joint(draft, PROMPT, cfg)) < ALPHA  # power
