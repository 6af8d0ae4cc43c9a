"""``method="auto"`` at temperature > 0 is distributed exactly as sampling the target alone.

Auto switches drafter from step to step (plain, n-gram, draft model, Medusa tree, EAGLE
drafter), so a request's output mixes all five verifications on one cache. Each is lossless on its
own; what this tests is that the mix is too: the first three tokens of many seeded
requests on a 6-token vocabulary are compared with the target's exact (filtered)
joint distribution, enumerated from the model itself, by Pearson's chi-square at
significance ALPHA = 1e-3 (cells with expected count < 5 pooled; fixed seeds, so a
run is deterministic: a correct build fails with probability 0.1% over the choice of
seeds, a biased one reliably).

* ``random`` choice: a seeded RNG, independent of the sampling generator, picks
  uniformly among the options available at each step, so every drafter runs often and
  requests switch mid-sequence;
* ``measured`` choice: auto's own chooser (its cost model and running acceptance), as users
  get it, on pinned costs: the timings a machine measures are replaced by a fixed
  curve, so which drafters run depends on the seeds and acceptance alone, not on how
  busy the machine is (on a loaded CI runner a measured draft cost can make auto
  choose plain for nearly every step, and the test would not test a mix);
* power: the same harness with one classic bug injected (the draft model's tokens
  verified against the wrong q, here uniform) must be rejected at the same ALPHA.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from specops.spec import auto, tree_size
from specops.spec import draft as draft_module
from specops.spec.auto import AutoEstimates, generate_auto
from specops.models.eagle_model import EagleDrafter
from specops.models.fast_llama import FastLlamaRunner
from specops.models.medusa_heads import MedusaHeads
from specops.spec.sampling import SamplingConfig, make_generator, probabilities
from specops.spec.tree_size import VerifyCostCurve
from tests.decoder.medusa_models import one_thread, tiny_model  # noqa: F401 (fixture)
from tests.decoder.test_tree_sampling import chi_square

ALPHA = 1e-3
VOCAB, LENGTH = 6, 3
PROMPT = [1, 4, 2, 1, 4]  # repeats, so the n-gram lookup has something to propose
SAMPLING = SamplingConfig(temperature=0.9, top_k=5)


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", vocab=VOCAB, seed=3)
    draft = tiny_model("llama", vocab=VOCAB, seed=3)
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(4.0)  # sharper distributions, so drafts are often accepted
        gen = torch.Generator().manual_seed(11)
        for p, p_target in zip(draft.parameters(), target.parameters()):  # the draft: a noisy copy
            p.copy_(p_target + 0.5 * float(p_target.std() if p_target.numel() > 1 else 1.0)
                    * torch.randn(p.shape, generator=gen))
    return target, draft


def _exact(model) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3 | PROMPT) under the filtered target, from one uncached forward per sequence."""
    seqs = list(itertools.product(range(VOCAB), repeat=LENGTH))
    prompt = torch.tensor([PROMPT])
    ids = torch.cat([prompt.expand(len(seqs), -1), torch.tensor(seqs)], dim=1)  # [S, P + LENGTH]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [S, P + LENGTH, V]
    probs = probabilities(logits[:, len(PROMPT) - 1 : -1], SAMPLING).double()  # [S, LENGTH, V]
    exact = probs.gather(2, torch.tensor(seqs)[:, :, None])[:, :, 0].prod(dim=1)  # [S]
    return {s: float(e) for s, e in zip(seqs, exact) if e > 0}


def _random_choice(seed: int, prefer: str | None = None):
    """A `Chooser.choose` that ignores the estimates: uniform over what is available (or
    always ``prefer`` when it is), from its own RNG (never the sampling generator)."""
    rng = random.Random(seed)

    def choose(self, available: dict[str, int]) -> str:
        self.step += 1
        if prefer in available:
            return prefer
        return rng.choice(sorted(available))

    return choose


def _sample(models, trials: int) -> tuple[dict[tuple[int, ...], int], dict[str, int], int]:
    """Counts of the first LENGTH tokens over ``trials`` seeded auto requests, steps per option, accepted."""
    target_model, draft_model = models
    target, draft = FastLlamaRunner(target_model), FastLlamaRunner(draft_model)
    heads = MedusaHeads.from_model(target_model, num_heads=2)
    eagle = EagleDrafter.for_target(target_model, seed=5).eval()
    estimates = AutoEstimates()
    counts: dict[tuple[int, ...], int] = {}
    steps: dict[str, int] = {}
    accepted = 0
    for i in range(trials):
        out, stats = generate_auto(target, torch.tensor([PROMPT]), draft=draft, heads=heads, sampling=SAMPLING,
                                   generator=make_generator(i), max_new_tokens=LENGTH, estimates=estimates,
                                   eagle=eagle, medusa_beside_eagle=True)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        accepted += stats.accepted
        for name, n in stats.auto_steps.items():
            steps[name] = steps.get(name, 0) + n
    return counts, steps, accepted


def test_auto_with_random_choices_samples_the_target_distribution(models, monkeypatch, one_thread):
    trials = 1500
    monkeypatch.setattr(auto.Chooser, "choose", _random_choice(seed=7))
    counts, steps, accepted = _sample(models, trials)
    assert all(steps.get(name, 0) > trials // 4 for name in ("plain", "ngram", "draft", "medusa", "eagle")), steps
    assert accepted > trials // 3, "drafts must actually be accepted for this test to mean anything"
    assert chi_square(counts, _exact(models[0]), trials) > ALPHA


# a typical small-model CPU cost shape (seconds): verifying 8 positions costs 1.5x one
PINNED_CURVE = VerifyCostCurve(sizes=(1, 2, 4, 8, 16), seconds=(1e-3, 1.05e-3, 1.15e-3, 1.5e-3, 2.2e-3))
PINNED_DRAFT_TOKEN_S, PINNED_HEADS_S = 0.25e-3, 0.05e-3


@pytest.fixture
def pinned_costs(monkeypatch):
    for module in (auto, tree_size):
        monkeypatch.setattr(module, "verify_cost_curve", lambda target: PINNED_CURVE)
        monkeypatch.setattr(module, "heads_overhead_s", lambda *args, **kwargs: PINNED_HEADS_S)
    monkeypatch.setattr(auto, "draft_token_s", lambda draft: PINNED_DRAFT_TOKEN_S)
    monkeypatch.setattr(auto, "eagle_token_s", lambda drafter: PINNED_DRAFT_TOKEN_S)
    monkeypatch.setattr(auto, "SCALE_WEIGHT", 0.0)  # nor the measured step times' corrections


def test_auto_with_its_own_choices_samples_the_target_distribution(models, pinned_costs, one_thread):
    trials = 1200
    counts, steps, accepted = _sample(models, trials)
    assert sum(n for name, n in steps.items() if name != "plain") > trials // 4, steps  # it speculated
    assert chi_square(counts, _exact(models[0]), trials) > ALPHA


@pytest.mark.parametrize("option", ["draft", "eagle"])
def test_the_test_rejects_auto_with_a_wrong_draft_distribution(models, monkeypatch, one_thread, option):
    """Power: the draft model's (or the EAGLE drafter's) tokens verified against a uniform q
    instead of the q they were drawn from."""
    from specops.spec import eagle as eagle_module

    trials = 1200
    module, name = (draft_module, "_draft_block") if option == "draft" else (eagle_module, "draft_chain")
    real = getattr(module, name)

    def wrong_q(*args, **kwargs):
        drafted, q = real(*args, **kwargs)
        return drafted, torch.full_like(q, 1.0 / q.shape[-1])  # [1, G, V]

    monkeypatch.setattr(module, name, wrong_q)
    monkeypatch.setattr(auto.Chooser, "choose", _random_choice(seed=7, prefer=option))
    counts, steps, _ = _sample(models, trials)
    assert steps.get(option, 0) >= trials, steps
    assert chi_square(counts, _exact(models[0]), trials) < ALPHA
