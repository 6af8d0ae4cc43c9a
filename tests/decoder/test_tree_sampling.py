"""Lossless tree sampling: the output of tree speculation is distributed exactly as the target's.

Chi-square goodness-of-fit tests at significance level ALPHA = 0.001 with fixed seeds
(so each run is deterministic; a correct implementation fails with probability 0.1%
per test over the choice of seed, a biased one fails reliably at these sample sizes).
Cells with expected count < 5 are pooled.
"""

from __future__ import annotations

import functools
import hashlib
import itertools

import pytest
import torch
from scipy.stats import chisquare

from specops.spec.medusa_decode import generate_medusa
from specops.models.medusa_heads import MedusaHeads
from specops.spec.sampling import SamplingConfig, make_generator, probabilities
from specops.spec.tree import build_buffers, preset
from specops.spec.tree_verify import verify_tree_sampling, verify_tree_typical, TypicalAcceptance
from tests.decoder.medusa_models import one_thread, tiny_model  # noqa: F401 (fixture)

ALPHA = 0.001


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:6], "little")


@functools.lru_cache(maxsize=None)
def synthetic_p(context: tuple[int, ...], vocab: int) -> torch.Tensor:  # -> [V]
    """A fixed random 'target model': next-token distribution for any context (some zeros)."""
    g = torch.Generator().manual_seed(_seed("p", context))
    logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5
    if context and context[-1] % 3 == 0:
        logits[context[-1] % vocab] = float("-inf")  # a token outside the support
    return torch.softmax(logits, dim=0)


def synthetic_q(context: tuple[int, ...], depth: int, vocab: int) -> torch.Tensor:  # -> [V]
    """A fixed random 'head' distribution: what a drafter would propose at depth `depth`."""
    g = torch.Generator().manual_seed(_seed("q", context, depth))
    return torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2.0, dim=0)


def chi_square(counts: dict, expected_probs: dict, trials: int) -> float:
    """p-value of the goodness-of-fit test, pooling cells with expected count < 5."""
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for cell, prob in expected_probs.items():
        if prob * trials < 5:
            pool_o += counts.get(cell, 0)
            pool_e += prob * trials
        else:
            obs.append(counts.get(cell, 0))
            exp.append(prob * trials)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    assert sum(counts.values()) == trials
    assert set(counts) <= set(expected_probs), "sampled a sequence the target gives probability 0"
    scale = sum(obs) / sum(exp)  # float rounding only: the expected probabilities sum to 1
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def exact_sequences(length: int, vocab: int) -> dict[tuple[int, ...], float]:
    probs = {}
    for seq in itertools.product(range(vocab), repeat=length):
        p = 1.0
        for j in range(length):
            p *= float(synthetic_p(seq[:j], vocab)[seq[j]])
        if p > 0:
            probs[seq] = p
    return probs


def simulate(trials: int, length: int, vocab: int, mode: str, seed: int) -> dict[tuple[int, ...], int]:
    """Full tree-speculative decoding against the synthetic target; counts of the first `length` tokens.

    mode "topk": deterministic candidates (each depth's top-k of its head distribution,
    q = point masses, as Medusa). mode "sampled": every candidate drawn from its head
    distribution q (siblings may repeat), verified against that q.
    """
    spec = preset("medium", 3)
    buffers = build_buffers(spec)
    gen = torch.Generator().manual_seed(seed)
    draft_gen = torch.Generator().manual_seed(seed + 1)
    counts: dict[tuple[int, ...], int] = {}
    parents = buffers.parent.tolist()
    depth = buffers.depth.tolist()
    for _ in range(trials):
        seq = [int(torch.multinomial(synthetic_p((), vocab).float(), 1, generator=gen))]
        while len(seq) < length:
            n = buffers.num_nodes
            tokens = [seq[-1]] + [0] * (n - 1)
            q = torch.zeros(n, vocab, dtype=torch.float64)
            if mode == "topk":
                top = torch.stack([torch.topk(synthetic_q(tuple(seq), d, vocab), buffers.top_k).indices
                                   for d in range(1, spec.depth + 1)]).reshape(-1)  # [D * top_k]
                for i in range(1, n):
                    tokens[i] = int(top[buffers.candidate_index[i - 1]])
            contexts = [tuple(seq)]
            for i in range(1, n):
                contexts.append(contexts[parents[i]] + (tokens[i],) if mode == "topk" else None)
                if mode == "sampled":
                    parent_ctx = contexts[parents[i]]
                    q[i] = synthetic_q(parent_ctx, depth[i], vocab)
                    tokens[i] = int(torch.multinomial(q[i].float(), 1, generator=draft_gen))
                    contexts[i] = parent_ctx + (tokens[i],)
            p = torch.stack([synthetic_p(c, vocab) for c in contexts])  # [N, V]
            result = verify_tree_sampling(torch.tensor(tokens), p, buffers, gen,
                                          draft_probs=q if mode == "sampled" else None)
            seq += [tokens[i] for i in result.path[1:]] + [result.next_token]
        key = tuple(seq[:length])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("mode", ["topk", "sampled"])
def test_tree_rejection_sampling_is_lossless(mode):
    vocab, length, trials = 4, 3, 4000
    counts = simulate(trials, length, vocab, mode, seed=1234)
    assert chi_square(counts, exact_sequences(length, vocab), trials) > ALPHA


def test_typical_acceptance_is_lossy():
    """The lossy mode really is lossy (the same harness detects its bias), so the lossless
    tests above have power."""
    vocab, trials = 4, 4000
    spec = preset("chain", 1)
    buffers = build_buffers(spec)
    gen = torch.Generator().manual_seed(5)
    p_root = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    probs = torch.stack([p_root, p_root])  # [N=2, V]
    counts = {}
    for _ in range(trials):
        # candidate token 1 (p = 0.3) is "plausible", so typical acceptance always takes it
        result = verify_tree_typical(torch.tensor([0, 1]), probs, buffers, gen, TypicalAcceptance())
        first = 1 if len(result.path) > 1 else result.next_token
        counts[(first,)] = counts.get((first,), 0) + 1
    assert chi_square(counts, {(t,): float(p_root[t]) for t in range(vocab)}, trials) < ALPHA


def test_medusa_sampling_matches_target_distribution(one_thread):
    """End to end on a real (tiny, random) model: generate_medusa at temperature 0.9 with
    top-k 6, first three tokens vs the exact filtered target distribution."""
    vocab, length, trials = 6, 3, 1200
    model = tiny_model("llama", vocab=vocab, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # sharper distributions, so the heads' candidates are often accepted
    from specops.models.fast_llama import FastLlamaRunner

    runner = FastLlamaRunner(model)
    heads = MedusaHeads.from_model(model, num_heads=2)
    sampling = SamplingConfig(temperature=0.9, top_k=5)
    prompt = torch.tensor([[1, 4, 2]])
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for i in range(trials):
        out, stats = generate_medusa(runner, prompt, heads=heads, sampling=sampling, generator=make_generator(i),
                                     max_new_tokens=length, tree="medium")
        accepted += stats.accepted
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    # exact: enumerate all continuations with the model itself, no cache
    seqs = list(itertools.product(range(vocab), repeat=length))
    ids = torch.cat([prompt.expand(len(seqs), -1), torch.tensor(seqs)], dim=1)  # [S, P + length]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [S, P + length, V]
    probs = probabilities(logits[:, prompt.shape[1] - 1 : -1], sampling).double()  # [S, length, V]
    seq_t = torch.tensor(seqs)
    exact = probs.gather(2, seq_t[:, :, None])[:, :, 0].prod(dim=1)  # [S]
    expected = {s: float(e) for s, e in zip(seqs, exact) if e > 0}
    assert accepted > trials // 3, "the tree must actually accept candidates for this test to mean anything"
    assert chi_square(counts, expected, trials) > ALPHA
