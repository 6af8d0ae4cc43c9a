"""Sampling filters and configuration: exact filtered distributions and clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specops.spec.errors import InvalidRequestError
from specops.spec.sampling import (
    SamplingConfig,
    filter_logits,
    make_generator,
    next_token,
    probabilities,
    sample,
)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_p": -0.2}, "top_p"),
        ({"temperature": 1.0, "top_k": 0}, "top_k"),
        ({"temperature": 1.0, "top_k": 2.5}, "top_k"),
    ],
)
def test_bad_config_names_the_field(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingConfig(**kwargs)


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    got = probabilities(logits, SamplingConfig(temperature=0.5))
    want = torch.softmax(logits / 0.5, dim=-1)
    torch.testing.assert_close(got, want)


def test_top_k_keeps_exactly_the_k_most_likely():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 1.0]])
    probs = probabilities(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.nonzero(probs[0]).flatten().tolist() == [1, 2]
    want = torch.softmax(torch.tensor([3.0, 2.0]), dim=-1)
    torch.testing.assert_close(probs[0, [1, 2]], want)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    base = torch.tensor([0.5, 0.25, 0.15, 0.10])
    logits = base.log()[None]  # [1, 4]
    # 0.5 < 0.7 -> add 0.25 (0.75 >= 0.7): nucleus {0, 1}
    probs = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs[0], torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    # exactly reaching p stops there: 0.5 + 0.25 = 0.75
    probs = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.75))
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    # the most likely token always survives
    probs = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    torch.testing.assert_close(probs[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # even for a top_p that float32 rounds to 0 (schemathesis sent 5e-324 to serve: NaN, a 500)
    for tiny in (5e-324, 1e-46):
        probs = probabilities(logits.repeat(3, 1), SamplingConfig(temperature=1.0, top_p=tiny))
        torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 3))


def test_top_k_then_top_p_compose_in_that_order():
    base = torch.tensor([0.4, 0.3, 0.2, 0.1])
    cfg = SamplingConfig(temperature=1.0, top_k=3, top_p=0.6)
    probs = probabilities(base.log()[None], cfg)[0]
    # after top-3 renormalisation: 0.444, 0.333, 0.222 -> nucleus for 0.6 is {0, 1}
    torch.testing.assert_close(probs, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_filters_act_row_by_row_on_batched_blocks():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))  # [B, G, V]
    cfg = SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)
    batched = probabilities(logits, cfg)
    for b in range(2):
        for g in range(3):
            torch.testing.assert_close(batched[b, g], probabilities(logits[b, g], cfg))


@settings(max_examples=30, deadline=None)
@given(
    vocab=st.integers(2, 40),
    temperature=st.floats(0.05, 5.0),
    top_k=st.one_of(st.none(), st.integers(1, 50)),
    top_p=st.one_of(st.none(), st.floats(0.01, 1.0)),
    seed=st.integers(0, 2**31 - 1),
)
def test_filtered_rows_are_distributions_within_the_limits(vocab, temperature, top_k, top_p, seed):
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * 3  # [R, V]
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = probabilities(logits, cfg)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert bool((probs >= 0).all())
    support = (probs > 0).sum(-1)
    if top_k is not None:
        assert int(support.max()) <= top_k
    # the argmax always stays in the support
    assert bool((probs.gather(1, logits.argmax(-1, keepdim=True)) > 0).all())


def test_greedy_is_raw_argmax_and_ignores_filters():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 1.0, 2.0]])
    cfg = SamplingConfig(temperature=0.0, top_k=1, top_p=0.1)
    assert cfg.greedy
    assert next_token(logits, cfg, make_generator(0)).tolist() == [1, 0]
    with pytest.raises(InvalidRequestError):
        filter_logits(logits, cfg)


def test_seeded_generator_reproduces_samples():
    probs = torch.full((1, 50), 1 / 50)
    a = [int(sample(probs, g)[0]) for g in [make_generator(7)] for _ in range(20)]
    gen = make_generator(7)
    b = [int(sample(probs, gen)[0]) for _ in range(20)]
    assert a == b
    gen2 = make_generator(8)
    assert [int(sample(probs, gen2)[0]) for _ in range(20)] != a


def test_bad_seed_is_rejected():
    with pytest.raises(InvalidRequestError, match="seed"):
        make_generator("7")  # type: ignore[arg-type]


def test_sample_matches_probabilities_by_frequency():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0]])
    gen = make_generator(3)
    draws = torch.stack([sample(probs, gen) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[3] == 0
    # 4000 draws: standard error of p=0.7 is ~0.0072; 5 sigma bound
    assert math.isclose(float(freq[0]), 0.7, abs_tol=0.036)
