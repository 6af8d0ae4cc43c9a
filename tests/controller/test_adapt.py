import math

import pytest

from specops.controller.adapt import (
    BanditState, Guard, Proposal, RoundModel, guarded_step, propose_bandit, propose_goodput,
)
from tests.controller.helpers import COSTS, window


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.9, 0.95])
@pytest.mark.parametrize("measured_at", [1, 4, 8])
def test_goodput_picks_the_optimal_gamma(alpha, measured_at):
    best_true = max(range(1, 13), key=lambda g: COSTS.speed(alpha, g))
    proposal = propose_goodput(window(alpha, measured_at), measured_at, 1, 12)
    assert proposal is not None
    # the model (extrapolated past the measured length) agrees with the true optimum
    assert proposal.target == best_true
    assert proposal.estimates[best_true] == pytest.approx(COSTS.speed(alpha, best_true), rel=0.02)


def test_goodput_respects_bounds_and_needs_drafts():
    assert propose_goodput(window(0.95, 4), 4, 2, 5).target == 5
    assert propose_goodput(window(0.2, 4), 4, 3, 8).target == 3
    empty = window(0.9, 4, rounds=0)
    assert propose_goodput(empty, 4, 1, 8) is None
    with pytest.raises(ValueError):
        propose_goodput(window(0.9, 4), 4, 5, 2)


def test_round_model_recovers_costs():
    model = RoundModel.fit(window(0.7, 3), 3)
    assert model.plain_s_per_token == pytest.approx(COSTS.plain_s)
    assert model.draft_s_per_token == pytest.approx(COSTS.draft_s)
    assert model.verify_s_per_extra_token == pytest.approx(COSTS.verify_slope_s, rel=1e-6)
    assert model.decay() == pytest.approx(0.7, rel=0.01)


GUARD = Guard(dead_band=0.05, cooldown_s=60, max_step=2, settle_s=30)


def test_guard_max_step_dead_band_and_cooldown():
    big = Proposal(target=8, expected_gain=0.30, reason="r")
    assert guarded_step(2, big, now=1000, last_change_at=None, guard=GUARD).value == 4  # max step 2
    small = Proposal(target=5, expected_gain=0.02, reason="r")
    step = guarded_step(4, small, now=1000, last_change_at=None, guard=GUARD)
    assert not step.changed and "dead band" in step.reason
    step = guarded_step(4, big, now=1000, last_change_at=970, guard=GUARD)
    assert not step.changed and "cooldown" in step.reason
    step = guarded_step(4, big, now=1000, last_change_at=939, guard=GUARD)
    assert step.changed and step.value == 6


def test_guard_timing_slack_tolerates_tick_jitter():
    big = Proposal(target=8, expected_gain=0.30, reason="r")
    # the tick that should end the 60 s cooldown read its clock 5 ms early: without slack it
    # waits a whole extra tick
    assert not guarded_step(4, big, now=1059.995, last_change_at=1000, guard=GUARD).changed
    jittery = Guard(dead_band=0.05, cooldown_s=60, max_step=2, settle_s=30, slack_s=0.3)
    assert guarded_step(4, big, now=1059.995, last_change_at=1000, guard=jittery).value == 6
    # the settle time likewise, and the slack is only a tolerance: 0.5 s early is still early
    settle = Guard(dead_band=0.05, cooldown_s=0, max_step=2, settle_s=30, slack_s=0.3)
    assert guarded_step(4, big, now=1029.9, last_change_at=1000, guard=settle).changed
    step = guarded_step(4, big, now=1029.5, last_change_at=1000, guard=settle)
    assert not step.changed and "settling" in step.reason
    assert not guarded_step(4, big, now=1059.5, last_change_at=1000, guard=jittery).changed


def test_guard_prevents_flapping_on_noisy_windows():
    # alternate windows whose optimum flips between 4 and 5 with a tiny gain: never moves
    value, last, changes = 4, None, 0
    for t in range(0, 600, 10):
        target = 5 if (t // 10) % 2 else 3
        step = guarded_step(value, Proposal(target, 0.01), now=t, last_change_at=last, guard=GUARD)
        if step.changed:
            value, last, changes = step.value, t, changes + 1
    assert changes == 0
    # large alternating gains: limited by the cooldown to one change per 60 s
    value, last, changes = 4, None, 0
    for t in range(0, 600, 10):
        target = 8 if (t // 10) % 2 else 1
        step = guarded_step(value, Proposal(target, 0.5), now=t, last_change_at=last, guard=GUARD)
        if step.changed:
            assert abs(step.value - value) <= 2
            value, last, changes = step.value, t, changes + 1
    assert changes <= 10


def _play(state, rewards, arm, steps):
    played = []
    for _ in range(steps):
        state.update(arm, rewards[arm])
        arm = propose_bandit(state, arm, 1, 8).target
        played.append(arm)
    return arm, played


def test_bandit_mostly_plays_the_best_arm_and_follows_a_shift():
    state = BanditState(discount=0.9, exploration=0.1)
    rewards = {k: COSTS.speed(0.9, k) * COSTS.plain_s for k in range(1, 9)}
    arm, played = _play(state, rewards, 4, 80)
    tail = played[-40:]
    assert max(set(tail), key=tail.count) == max(rewards, key=rewards.get)
    shifted = {k: COSTS.speed(0.4, k) * COSTS.plain_s for k in range(1, 9)}
    arm, played = _play(state, shifted, arm, 120)
    tail = played[-40:]
    assert max(set(tail), key=tail.count) == max(shifted, key=shifted.get)


def test_bandit_explores_unplayed_arms_first():
    state = BanditState()
    p = propose_bandit(state, 3, 1, 5)
    assert p.target == 3 and math.isinf(p.expected_gain)
    state.update(3, 1.0)
    assert propose_bandit(state, 3, 1, 5).target in (2, 4)


def test_goodput_fit_takes_plain_requests_out_of_a_fallen_back_window():
    """A fallen-back class's window: 90% plain requests plus probes at γ 1. Fitted with
    ``with_plain`` it models the probes as a window of probes alone would; fitted as is, the
    plain requests' target time looks like verify cost and makes every longer γ look bad."""
    from tests.controller.test_fallback import _mixed

    mixed, probes = _mixed(0.9), window(0.9, 1, rounds=1000)
    alone = RoundModel.fit(probes, 1)
    fitted = RoundModel.fit(mixed, 1, with_plain=True)
    for k in (1, 3, 5, 8):
        assert fitted.goodput(k) == pytest.approx(alone.goodput(k), rel=1e-6)
    assert propose_goodput(mixed, 1, 1, 12, with_plain=True).target == propose_goodput(probes, 1, 1, 12).target == 5
    assert propose_goodput(mixed, 1, 1, 12).target == 1  # the bias the option removes


@pytest.mark.parametrize("alpha", [0.6, 0.85])
def test_goodput_reads_rounds_of_varying_length_from_drafted_per_pos(alpha):
    """The serving engine shortens blocks under load below the class's γ (6 here): half
    the rounds drafted 6 tokens, half 2. With ``drafted_per_pos`` the model recovers
    the per-position acceptance and the costs and picks the true optimum; without it
    (every round taken to have drafted 6) rounds are undercounted and the verify cost
    per round inflated."""
    long, short = window(alpha, 6, rounds=5000), window(alpha, 2, rounds=5000)
    mixed = long.merge(short)
    mixed.drafted_per_pos = [10_000, 10_000] + [5000] * 4
    model = RoundModel.fit(mixed, 6)
    assert model.rounds == 10_000
    for i, p in enumerate(model.position_accept):
        assert p == pytest.approx(alpha ** (i + 1), rel=0.01)
    assert model.verify_s_per_extra_token == pytest.approx(COSTS.verify_slope_s, rel=1e-6)
    assert model.draft_s_per_token == pytest.approx(COSTS.draft_s)
    best_true = max(range(1, 13), key=lambda g: COSTS.speed(alpha, g))
    assert propose_goodput(mixed, 6, 1, 12).target == best_true
    legacy = long.merge(short)  # no drafted_per_pos: the old reading
    assert RoundModel.fit(legacy, 6).rounds == pytest.approx(mixed.drafted / 6)
    assert propose_goodput(legacy, 6, 1, 12).target != best_true  # (2 for both alphas)
    incomplete = long.merge(short)
    incomplete.drafted_per_pos = [5000, 5000]  # does not sum to drafted: not trusted
    assert RoundModel.fit(incomplete, 6).rounds == pytest.approx(mixed.drafted / 6)
