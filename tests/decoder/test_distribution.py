"""Lossless sampling: speculative output is distributed exactly as the (filtered) target.

Statistical tests use Pearson's chi-square at significance ALPHA = 1e-3 with fixed
seeds, so each test is deterministic: it either always passes or always fails on a
given build. Cells whose expected count is below 5 are pooled, as the chi-square
approximation requires. A deliberately biased sampler is run through the same test to
show that it has the power to fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from specops.decoder import Decoder
from specops.spec.sampling import SamplingConfig, probabilities
from specops.spec.verify import verify_sampling
from tests.decoder.tiny_models import perturbed, tiny_llama

ALPHA = 1e-3


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` [C] under cell probabilities ``probs`` [C]."""
    counts = counts.double()
    probs = probs.double() / probs.double().sum()
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0  # an impossible outcome occurred
    n = float(counts.sum())
    expected = probs * n
    order = torch.argsort(expected)
    obs_cells, exp_cells = [], []
    acc_o = acc_e = 0.0
    for i in order.tolist():
        if expected[i] == 0:
            continue
        acc_o += float(counts[i])
        acc_e += float(expected[i])
        if acc_e >= 5.0:
            obs_cells.append(acc_o)
            exp_cells.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:  # leftovers join the last pooled cell
        obs_cells[-1] += acc_o
        exp_cells[-1] += acc_e
    if len(obs_cells) < 2:
        return 1.0
    scale = sum(obs_cells) / sum(exp_cells)  # float rounding of the probabilities
    return float(chisquare(obs_cells, [e * scale for e in exp_cells]).pvalue)


V = 6
PAIRS = {
    "random": (torch.tensor([0.3, 0.1, 0.25, 0.05, 0.2, 0.1]), torch.tensor([0.1, 0.3, 0.1, 0.2, 0.1, 0.2])),
    "disjoint_supports": (torch.tensor([0.0, 0.0, 0.0, 0.5, 0.3, 0.2]), torch.tensor([0.6, 0.3, 0.1, 0.0, 0.0, 0.0])),
    "q_uniform_p_peaked": (torch.tensor([0.9, 0.02, 0.02, 0.02, 0.02, 0.02]), torch.full((V,), 1 / V)),
    "p_uniform_q_peaked": (torch.full((V,), 1 / V), torch.tensor([0.9, 0.02, 0.02, 0.02, 0.02, 0.02])),
    "q_misses_part_of_p": (torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1]), torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])),
    "p_misses_part_of_q": (torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0]), torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0, 0.0])),
    "identical": (torch.tensor([0.3, 0.1, 0.25, 0.05, 0.2, 0.1]), torch.tensor([0.3, 0.1, 0.25, 0.05, 0.2, 0.1])),
}
N = 20_000


def _first_emitted(p: torch.Tensor, q: torch.Tensor, seed: int, biased: bool = False) -> torch.Tensor:
    """First token emitted by one verification step (G = 1) in N independent rows."""
    gen = torch.Generator().manual_seed(seed)
    p_block = torch.stack([p, torch.full((V,), 1 / V)])[None].expand(N, 2, V).contiguous()  # [N, 2, V]
    q_block = q[None, None].expand(N, 1, V).contiguous()  # [N, 1, V]
    draft = torch.multinomial(q_block[:, 0], 1, generator=gen)  # [N, 1]
    if biased:  # the classic bug: recover from p itself instead of the residual
        accept = torch.rand(N, generator=gen) * q_block[:, 0].gather(1, draft)[:, 0] < p_block[:, 0].gather(1, draft)[:, 0]
        recovered = torch.multinomial(p_block[:, 0], 1, generator=gen)[:, 0]
        return torch.where(accept, draft[:, 0], recovered)
    res = verify_sampling(draft, p_block, q_block, gen)
    return torch.where(res.accepted >= 1, draft[:, 0], res.next_tokens)  # [N]


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_rejection_sampler_reproduces_target_distribution(name):
    p, q = PAIRS[name]
    first = _first_emitted(p, q, seed=sorted(PAIRS).index(name))
    counts = torch.bincount(first, minlength=V)
    assert chi_square_pvalue(counts, p) > ALPHA, (name, counts.tolist(), (p * N).tolist())


def test_the_chi_square_test_detects_a_biased_sampler():
    p, q = PAIRS["random"]
    first = _first_emitted(p, q, seed=0, biased=True)
    counts = torch.bincount(first, minlength=V)
    assert chi_square_pvalue(counts, p) < ALPHA


def test_bonus_token_follows_the_target_after_a_fully_accepted_block():
    gen = torch.Generator().manual_seed(5)
    q = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    bonus = torch.tensor([0.1, 0.2, 0.3, 0.0, 0.4, 0.0])
    n = 5000
    p_block = torch.stack([q, q, bonus])[None].expand(n, 3, V).contiguous()  # p == q on the block
    q_block = q[None, None].expand(n, 2, V).contiguous()
    draft = torch.multinomial(q_block.reshape(-1, V), 1, generator=gen).reshape(n, 2)
    res = verify_sampling(draft, p_block, q_block, gen)
    assert bool((res.accepted == 2).all())
    assert chi_square_pvalue(torch.bincount(res.next_tokens, minlength=V), bonus) > ALPHA


# -- end to end on a 4-token vocabulary ---------------------------------------------------
TINY_V = 4
STEPS = 3  # joint distribution of the first three generated tokens: 64 cells


@pytest.fixture(scope="module")
def tiny_vocab_pair():
    target = tiny_llama(seed=3, vocab=TINY_V, hidden=32, init_range=0.3)
    draft = perturbed(target, noise=0.8, seed=4)  # far enough off to reject often
    return target, draft


def _exact_joint(model, prompt: list[int], cfg: SamplingConfig) -> torch.Tensor:  # -> [V**STEPS]
    """P(x1, x2, x3 | prompt) from the target's own forward, filtered like the decoder filters."""
    probs = torch.zeros(TINY_V**STEPS, dtype=torch.float64)
    with torch.no_grad():
        for seq in itertools.product(range(TINY_V), repeat=STEPS):
            ids = torch.tensor([prompt + list(seq[:-1])])
            step_probs = probabilities(model(ids).logits[0, len(prompt) - 1 :], cfg)  # [STEPS, V]
            pr = 1.0
            for i, tok in enumerate(seq):
                pr *= float(step_probs[i, tok])
            probs[int("".join(map(str, seq)), TINY_V)] = pr
    return probs


@pytest.mark.parametrize(
    "method, samples, cfg",
    [
        ("draft", 2000, SamplingConfig(temperature=1.0)),
        ("draft", 1200, SamplingConfig(temperature=0.8, top_k=3, top_p=0.9)),
        ("ngram", 1500, SamplingConfig(temperature=1.0)),
    ],
    ids=["draft-t1", "draft-filtered", "ngram-t1"],
)
def test_end_to_end_joint_distribution_matches_target(tiny_vocab_pair, method, samples, cfg):
    target, draft = tiny_vocab_pair
    dec = Decoder(target, draft=draft)
    prompt = [1, 2, 3, 1, 2]  # repeats so prompt lookup drafts something
    counts = torch.zeros(TINY_V**STEPS, dtype=torch.long)
    drafted = 0
    for seed in range(samples):
        out = dec.generate(
            prompt, method=method, gamma=2, max_new_tokens=STEPS, seed=seed,
            temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
        )
        counts[int("".join(map(str, out.tokens)), TINY_V)] += 1
        drafted += out.stats.drafted
    assert drafted > samples  # speculation really happened (not a plain-decoding fallback)
    assert chi_square_pvalue(counts, _exact_joint(target, prompt, cfg)) > ALPHA
