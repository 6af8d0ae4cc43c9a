"""Bad decoder input raises a named error: hand-built trees, sampling fields, budgets,
context, Medusa-only options, a shared runner; tree sampling draws on its generator's device."""

from __future__ import annotations

import pytest
import torch

from specops.decoder import ContextLengthError, Decoder, InvalidRequestError, SamplingConfig
from specops.spec.sampling import make_generator
from specops.spec.tree import TreeError, TreeSpec, build_buffers, make_spec
from specops.spec.tree_verify import verify_tree_sampling
from tests.decoder.tiny_models import tiny_llama


@pytest.fixture(scope="module")
def decoder():
    return Decoder(tiny_llama(0), draft=tiny_llama(1))


def test_tree_spec_built_by_hand_is_validated():
    with pytest.raises(TreeError, match="sorted"):
        TreeSpec(paths=((0, 0), (0,)))  # unsorted paths would give wrong parents and mask
    with pytest.raises(TreeError, match="no parent"):
        TreeSpec(paths=((0, 1),))  # a TreeError naming the orphan, not a bare KeyError
    spec = TreeSpec(paths=((0,), (1,), (0, 0)))
    assert spec == make_spec([(0, 0), (1,), (0,)])
    assert build_buffers(spec, "cpu").attn_mask[3].tolist() == [True, True, False, True]


def test_tiny_temperature_and_huge_seed_name_the_field(decoder):
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingConfig(temperature=1e-40)
    with pytest.raises(InvalidRequestError, match="seed"):
        make_generator(2**64)
    with pytest.raises(InvalidRequestError, match="seed"):
        decoder.generate([1, 2, 3], temperature=1.0, seed=2**64)
    assert decoder.generate([1, 2, 3], temperature=1.0, seed=2**64 - 1, max_new_tokens=2).tokens


def test_medusa_validates_max_new_tokens_and_context_like_the_others():
    from specops.spec.medusa_decode import generate_medusa
    from tests.decoder.test_medusa import random_heads

    model = tiny_llama(0)
    dec = Decoder(model, medusa=random_heads(model, 2, seed=0))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidRequestError, match="max_new_tokens"):
            generate_medusa(dec.target, torch.tensor([[1, 2]]), heads=dec.medusa, sampling=SamplingConfig(),
                            generator=make_generator(0), max_new_tokens=bad)
    too_long = [1] * dec.target.max_context
    for method in ("ar", "medusa", "ngram"):
        with pytest.raises(ContextLengthError):
            dec.generate(too_long, method=method)


def test_heads_and_tree_are_rejected_outside_medusa(decoder):
    for method in ("ar", "draft", "ngram", "auto"):
        with pytest.raises(InvalidRequestError, match="medusa"):
            decoder.generate([1, 2, 3], method=method, heads=2)
        with pytest.raises(InvalidRequestError, match="medusa"):
            decoder.generate([1, 2, 3], method=method, tree="small")


def test_draft_and_target_may_not_share_one_runner(decoder):
    with pytest.raises(InvalidRequestError, match="same runner"):
        Decoder(decoder.target, draft=decoder.target)


def test_tree_sampling_draws_uniforms_on_the_generator_device(monkeypatch):
    spec = make_spec([(0,), (1,), (0, 0)])
    buffers = build_buffers(spec, "cpu")
    probs = torch.full((4, 8), 1 / 8)  # [N, V]
    tokens = torch.tensor([0, 1, 2, 3])  # [N]
    calls = []
    real_rand = torch.rand

    def recording_rand(*args, **kwargs):
        calls.append(kwargs.get("device"))
        return real_rand(*args, **kwargs)

    monkeypatch.setattr(torch, "rand", recording_rand)
    gen = make_generator(0)
    verify_tree_sampling(tokens, probs, buffers, gen)
    assert calls and all(device == gen.device for device in calls)
    assert len(calls) <= spec.depth + 1  # one batch of sibling uniforms per visited node, not one per child
