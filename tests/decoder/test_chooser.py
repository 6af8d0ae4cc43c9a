"""The one rule of method="auto": untried options first, then the best, worse ones tried as due."""

from __future__ import annotations

import pytest

from specops.spec.chooser import ChoiceClock, ProbeRule, choose


def _run(rates: dict[str, float], rule: ProbeRule, n: int, **kw) -> list[str]:
    clock = ChoiceClock()
    picks = []
    for _ in range(n):
        picked = choose(rates, clock, rule, **kw)
        clock.used(picked)
        picks.append(picked)
    return picks


def test_untried_options_go_first_in_turn():
    clock = ChoiceClock()
    rule = ProbeRule(every=2, budget=0.1, max_wait=10)
    got = [choose({"a": 1.0, "b": 1.0, "c": 1.0}, clock, rule, untried=["a", "b", "c"]) for _ in range(3)]
    assert sorted(got) == ["a", "b", "c"]


def test_a_worse_option_waits_by_its_loss_over_the_budget():
    rule = ProbeRule(every=2, budget=0.05, max_wait=100)
    picks = _run({"best": 2.0, "worse": 1.6}, rule, 400)  # loss 0.25: one try per 5 choices' worth of budget
    at = [i for i, p in enumerate(picks) if p == "worse"]
    gaps = {b - a for a, b in zip(at, at[1:])}
    assert gaps == {5}, gaps  # 0.25 / 0.05
    assert rule.wait(2.0, 0.1) == 100  # a hopeless option still comes back within max_wait
    assert rule.wait(2.0, 2.0) == 2  # one as good as the best, every `every`


def test_hoped_and_fixed_waits_set_how_soon_an_option_comes_back():
    rule = ProbeRule(every=2, budget=0.05, max_wait=100)
    hopeful = _run({"best": 2.0, "worse": 1.0}, rule, 200, hoped=lambda o: 2.0)
    at = [i for i, p in enumerate(hopeful) if p == "worse"]
    assert {b - a for a, b in zip(at, at[1:])} == {2}  # read at its bound, as good as the best: every `every`
    fixed = _run({"best": 2.0, "plain": 1.9}, rule, 200, fixed_wait={"plain": 50})
    at = [i for i, p in enumerate(fixed) if p == "plain"]
    assert all(b - a == 50 for a, b in zip(at, at[1:])) and len(at) >= 3


def test_bad_rules_and_empty_choices_are_refused():
    with pytest.raises(ValueError, match="probe rule"):
        ProbeRule(every=0, budget=0.1, max_wait=10)
    with pytest.raises(ValueError, match="probe rule"):
        ProbeRule(every=20, budget=0.1, max_wait=10)
    with pytest.raises(ValueError, match="probe rule"):
        ProbeRule(every=2, budget=0.0, max_wait=10)
    with pytest.raises(ValueError, match="at least one"):
        choose({}, ChoiceClock(), ProbeRule(every=2, budget=0.1, max_wait=10))
