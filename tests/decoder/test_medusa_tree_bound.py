"""A policy's ``tree_size`` reaches Medusa decoding as an upper bound on the tree's nodes."""

from __future__ import annotations

import random

import pytest
import torch

from specops.spec.autoregressive import generate_ar
from specops.spec.errors import InvalidRequestError
from specops.models.fast_llama import FastLlamaRunner
from specops.spec.medusa_decode import generate_medusa
from specops.spec.tree_size import plan_tree
from specops.models.medusa_heads import MedusaHeads
from specops.spec.sampling import SamplingConfig, make_generator
from tests.decoder.medusa_models import one_thread, tiny_model  # noqa: F401 (fixture)

GREEDY = SamplingConfig()


def _case(accuracy):
    model = tiny_model("llama", vocab=48, seed=3, context=96)
    heads = MedusaHeads.from_model(model, num_heads=3)
    if accuracy is not None:
        heads.with_accuracy(accuracy)
    return FastLlamaRunner(model), heads


@pytest.mark.parametrize("accuracy", [[[0.7, 0.15, 0.08, 0.05]] * 3, None])
def test_tree_size_bounds_the_planned_tree_and_output_stays_exact(accuracy, one_thread):
    runner, heads = _case(accuracy)
    for bound in (1, 2, 3, 5):
        assert plan_tree(runner, heads, 3, max_nodes=bound).num_nodes <= bound
    rng = random.Random(7)
    for i in range(24):
        prompt = torch.tensor([[rng.randrange(48) for _ in range(rng.randint(1, 8))]])
        bound = rng.choice([1, 2, 4, 8, 64])
        want, _ = generate_ar(runner, prompt, sampling=GREEDY, generator=make_generator(0), max_new_tokens=16)
        got, _ = generate_medusa(runner, prompt, heads=heads, sampling=GREEDY, generator=make_generator(0),
                                 max_new_tokens=16, num_heads=3, tree=bound)
        assert got == want, f"prompt {i}, tree bound {bound}"


def test_bad_tree_bound_is_a_request_error(one_thread):
    runner, heads = _case(None)
    with pytest.raises(InvalidRequestError, match=">= 1 node"):
        generate_medusa(runner, torch.tensor([[1, 2]]), heads=heads, sampling=GREEDY, generator=make_generator(0),
                        max_new_tokens=4, tree=0)


def test_planned_trees_learn_from_the_steps_they_run(one_thread):
    """A planned tree (none given, or a bound) times each whole step into the runner's live
    planner, which every later request of the same runner and heads shares; the output stays
    `ar`'s whatever size each step took."""
    from specops.spec.tree_size import tree_planner

    runner, heads = _case([[0.7, 0.15, 0.08, 0.05]] * 3)
    prompt = torch.tensor([[5, 9, 11, 2]])
    want, _ = generate_ar(runner, prompt, sampling=GREEDY, generator=make_generator(0), max_new_tokens=24)
    for tree in (None, 4):
        planner = tree_planner(runner, heads, 3, max_nodes=tree)
        seen = sum(planner.samples.values())
        got, stats = generate_medusa(runner, prompt, heads=heads, sampling=GREEDY, generator=make_generator(0),
                                     max_new_tokens=24, num_heads=3, tree=tree)
        assert got == want
        assert sum(planner.samples.values()) > seen  # its steps were timed
        assert tree_planner(runner, heads, 3, max_nodes=tree) is planner  # and kept for the next request
        if tree is not None:
            assert max(planner.sizes) <= tree
