"""Sampled batched speculation is distributed like plain sampling of the target.

Requests of every speculative method (and ``auto``, which picks one per request from
the results of earlier ones) run 16 at a time in the engine (ragged drafts and
trees in one forward, per-request seeded generators) on a 4-token vocabulary; the joint
distribution of the first three tokens (64 cells) is compared with the target's exact
one by Pearson's chi-square at significance ALPHA = 1e-3 (cells pooled to expected
counts >= 5; fixed seeds, so the test is deterministic). The same test rejects a
biased engine (greedy drafts accepted without rejection sampling), which shows its power.
"""

from __future__ import annotations

import pytest
import torch

from specops.decoder import Decoder
from specops.models.medusa_heads import MedusaHeads
from specops.spec.sampling import SamplingConfig
from specops.engine import engine as engine_module
from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings
from tests.decoder.test_distribution import ALPHA, STEPS, TINY_V, _exact_joint, chi_square_pvalue
from tests.decoder.tiny_models import perturbed, tiny_llama
from tests.serving.test_engine import full_speculation

PROMPT = [1, 2, 3, 1, 2]  # repeats, so prompt lookup drafts something


@pytest.fixture(scope="module")
def dec():
    torch.set_num_threads(1)
    target = tiny_llama(seed=3, vocab=TINY_V, hidden=32, init_range=0.3)
    draft = perturbed(target, noise=0.8, seed=4)
    return Decoder(target, draft=draft, medusa=MedusaHeads.from_model(target, 2))


def sample_counts(dec: Decoder, method: str, n: int, cfg: SamplingConfig,
                  seed0: int = 0) -> tuple[torch.Tensor, int, dict[str, int]]:
    """Joint counts of the first STEPS tokens of ``n`` seeded requests, tokens drafted, requests per method run."""
    eng = full_speculation(Engine(dec, max_batch=16, kv_cache_mb=1, calibrate=False, eos_token_id=None))
    params = dict(max_tokens=STEPS, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    for i in range(n):
        eng.add(f"r{i}", PROMPT, SamplingParams(seed=seed0 + i, **params),
                SpecSettings(method=method, gamma=2, tree_size=6))
    tokens: dict[str, list[int]] = {}
    drafted = 0
    ran: dict[str, int] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                drafted += out.record.drafted
                ran[out.record.method] = ran.get(out.record.method, 0) + 1
    counts = torch.zeros(TINY_V**STEPS, dtype=torch.long)
    for toks in tokens.values():
        assert len(toks) == STEPS
        counts[int("".join(map(str, toks)), TINY_V)] += 1
    return counts, drafted, ran


@pytest.mark.parametrize(
    "method, n, cfg",
    [
        ("draft", 1500, SamplingConfig(temperature=1.0)),
        ("draft", 1000, SamplingConfig(temperature=0.8, top_k=3, top_p=0.9)),
        ("ngram", 1200, SamplingConfig(temperature=1.0)),
        ("medusa", 1200, SamplingConfig(temperature=1.0)),
        ("auto", 1200, SamplingConfig(temperature=1.0)),
    ],
    ids=["draft-t1", "draft-filtered", "ngram-t1", "medusa-t1", "auto-t1"],
)
def test_batched_speculative_sampling_matches_the_target(dec, method, n, cfg):
    counts, drafted, ran = sample_counts(dec, method, n, cfg)
    assert drafted > n // 2  # speculation really happened
    if method == "auto":  # per request, from live results: every loaded method ran in the mix
        assert {"ngram", "draft", "medusa"} <= set(ran), ran
    assert chi_square_pvalue(counts, _exact_joint(dec.target_model, PROMPT, cfg)) > ALPHA


def test_the_test_rejects_a_biased_engine(dec, monkeypatch):
    def accept_everything(logits, drafted, draft_probs, sampling, generator, choice=None):  # biased: no rejection
        from specops.spec.sampling import probabilities

        g = len(drafted)
        nxt = torch.multinomial(probabilities(logits[g], sampling), 1, generator=generator)
        return g, int(nxt[0])

    monkeypatch.setattr(engine_module, "judge_block", accept_everything)
    cfg = SamplingConfig(temperature=1.0)
    counts, _, _ = sample_counts(dec, "draft", 1000, cfg)
    assert chi_square_pvalue(counts, _exact_joint(dec.target_model, PROMPT, cfg)) < ALPHA
