"""γ schedules: constant, heuristic grow/shrink, goodput maximising expected tokens/s."""

from __future__ import annotations

import random

import pytest

from specops.spec.errors import InvalidRequestError
from specops.spec.schedule import (
    ConstantSchedule,
    GoodputSchedule,
    HeuristicSchedule,
    expected_tokens,
    make_schedule,
)


def test_constant_never_moves():
    s = make_schedule("constant", 5)
    for drafted, accepted in [(5, 5), (5, 0), (5, 2)]:
        s.update(drafted, accepted, 0.01, 0.02)
        assert s.next_gamma() == 5
    assert isinstance(s, ConstantSchedule)


def test_heuristic_grows_on_full_acceptance_and_shrinks_on_rejection_within_bounds():
    s = make_schedule("heuristic", 4, gamma_min=2, gamma_max=7)
    assert isinstance(s, HeuristicSchedule)
    trace = []
    for accepted_all in [True, True, True, False, False, False, False, False]:
        g = s.next_gamma()
        s.update(g, g if accepted_all else g - 1, 0.0, 0.0)
        trace.append(s.next_gamma())
    assert trace == [6, 7, 7, 6, 5, 4, 3, 2]
    s.update(2, 0, 0.0, 0.0)
    assert s.next_gamma() == 2  # never below gamma_min
    s.update(0, 0, 0.0, 0.0)  # a step that drafted nothing teaches nothing
    assert s.next_gamma() == 2


def test_heuristic_start_is_clamped_into_bounds():
    assert make_schedule("heuristic", 12, gamma_min=1, gamma_max=8).next_gamma() == 8


def test_expected_tokens_matches_the_closed_form_and_a_simulation():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    rng = random.Random(0)
    alpha, gamma, n = 0.7, 4, 40_000
    total = 0
    for _ in range(n):
        k = 0
        while k < gamma and rng.random() < alpha:
            k += 1
        total += k + 1
    assert total / n == pytest.approx(expected_tokens(alpha, gamma), rel=0.02)


def _feed(s: GoodputSchedule, alpha: float, draft_cost: float, verify_fixed: float, verify_per_token: float,
          steps: int = 60, seed: int = 0) -> list[int]:
    """Simulate steps at true acceptance ``alpha`` and linear costs; return the γ trace."""
    rng = random.Random(seed)
    trace = []
    for _ in range(steps):
        g = s.next_gamma()
        trace.append(g)
        k = 0
        while k < g and rng.random() < alpha:
            k += 1
        s.update(g, k, g * draft_cost, verify_fixed + verify_per_token * (g + 1))
    return trace


def best_gamma(alpha, draft_cost, verify_fixed, verify_per_token, lo, hi):
    return max(range(lo, hi + 1),
               key=lambda g: expected_tokens(alpha, g) / (g * draft_cost + verify_fixed + verify_per_token * (g + 1)))


@pytest.mark.parametrize(
    "alpha, draft_cost, verify_fixed, verify_per_token",
    [
        (0.9, 0.02, 1.0, 0.01),  # cheap draft, high acceptance: long blocks
        (0.3, 0.2, 1.0, 0.05),  # poor acceptance, costly draft: short blocks
        (0.7, 0.1, 1.0, 0.02),
    ],
)
def test_goodput_converges_to_the_rate_maximising_gamma(alpha, draft_cost, verify_fixed, verify_per_token):
    s = make_schedule("goodput", 4, gamma_min=1, gamma_max=10)
    trace = _feed(s, alpha, draft_cost, verify_fixed, verify_per_token, steps=300)
    best = best_gamma(alpha, draft_cost, verify_fixed, verify_per_token, 1, 10)
    tail = trace[-100:]
    # the acceptance estimate is noisy (decayed counts), so allow a neighbour of the optimum
    assert max(abs(g - best) for g in tail) <= 2, (best, tail)
    assert abs(sum(tail) / len(tail) - best) <= 1.0, (best, tail)


def test_goodput_prefers_long_blocks_when_acceptance_is_high_and_short_when_low():
    high = _feed(make_schedule("goodput", 4, 1, 8), 0.95, 0.02, 1.0, 0.0)
    low = _feed(make_schedule("goodput", 4, 1, 8), 0.1, 0.3, 1.0, 0.0)
    assert high[-1] >= 7 and low[-1] <= 2


def test_goodput_stays_in_bounds_and_waits_for_measurements():
    s = make_schedule("goodput", 3, gamma_min=2, gamma_max=5)
    assert s.next_gamma() == 3  # nothing measured yet
    trace = _feed(s, 1.0, 0.0, 1.0, 0.0, steps=20) + _feed(s, 0.0, 1.0, 1.0, 0.0, steps=40)
    assert min(trace) >= 2 and max(trace) <= 5
    assert trace[19] == 5 and trace[-1] == 2


def test_goodput_fits_the_verify_cost_line():
    s = GoodputSchedule(4, 1, 8)
    for g in (1, 3, 5, 7, 2, 6):
        s.update(g, g, 0.01 * g, 0.5 + 0.1 * (g + 1))
    assert s.verify_cost(5) == pytest.approx(0.5 + 0.1 * 5, rel=1e-6)
    assert s.draft_cost() == pytest.approx(0.01)


@pytest.mark.parametrize(
    "args, needle",
    [
        (("constant", 0), "gamma must be >= 1"),
        (("constant", -2), "gamma must be >= 1"),
        (("heuristic", 4, 0, 8), "gamma_min"),
        (("goodput", 4, 6, 3), "gamma_min .6. must be <= gamma_max .3."),
        (("sometimes", 4), "unknown schedule"),
        (("constant", 2.5), "gamma must be an integer"),
    ],
)
def test_bad_schedule_arguments_are_named(args, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        make_schedule(*args)
