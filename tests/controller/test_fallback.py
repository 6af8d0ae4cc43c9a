import pytest

from specops.controller.fallback import INCONCLUSIVE, OK, VIOLATED, FallbackManager, RuleTracker, judge
from specops.policies import AlertRule
from tests.controller.helpers import window

SLOWER = AlertRule(name="slower", metric="speedup", op="<", threshold=1.0, for_s=20, min_samples=500,
                   action="fallback")
LOW_ACCEPT = AlertRule(name="low-accept", metric="acceptance_rate", op="<", threshold=0.5, for_s=0, min_samples=10,
                       action="fallback")

SLOW = window(0.9, 4, draft_factor=10)  # speculation slower than plain
FAST = window(0.9, 4)
TINY = window(0.05, 4, rounds=50)  # very slow but only 200 drafted tokens


def test_judge_outcomes():
    assert SLOW.speedup < 1 < FAST.speedup
    assert judge(SLOWER, "c", SLOW).outcome == VIOLATED
    assert judge(SLOWER, "c", FAST).outcome == OK
    assert judge(SLOWER, "c", None).outcome == INCONCLUSIVE
    low = judge(SLOWER, "c", TINY)
    assert low.outcome == INCONCLUSIVE and "min_samples" in low.reason
    assert judge(LOW_ACCEPT, "c", window(0.3, 2)).outcome == VIOLATED


def test_fires_only_after_for_duration_and_resets_on_ok():
    tracker = RuleTracker()
    assert not tracker.evaluate(SLOWER, "c", SLOW, 0).firing
    assert not tracker.evaluate(SLOWER, "c", SLOW, 10).firing
    assert tracker.evaluate(SLOWER, "c", SLOW, 20).firing
    assert not tracker.evaluate(SLOWER, "c", FAST, 30).firing  # reset
    assert not tracker.evaluate(SLOWER, "c", SLOW, 40).firing
    assert tracker.evaluate(SLOWER, "c", SLOW, 60).firing


def test_inconclusive_neither_fires_nor_resets():
    tracker = RuleTracker()
    tracker.evaluate(SLOWER, "c", SLOW, 0)
    for t in (10, 20, 30):
        out = tracker.evaluate(SLOWER, "c", None, t)
        assert out.outcome == INCONCLUSIVE and not out.firing
        assert not tracker.evaluate(SLOWER, "c", TINY, t + 1).firing
    assert tracker.evaluate(SLOWER, "c", SLOW, 40).firing  # pending since 0 survived the gap


def _mixed(probe_alpha: float, probe_draft_factor: float = 1.0):
    """A fallen-back class: 90% plain requests plus 10% speculative probes."""
    plain = window(0.0, 1, rounds=9000)
    plain.drafted = plain.accepted = 0
    plain.accepted_per_pos = []
    plain.draft_s = 0.0
    plain.verify_s = plain.wall_s = plain.plain_s_estimate = plain.new_tokens * 0.02
    return plain.merge(window(probe_alpha, 1, rounds=1000, draft_factor=probe_draft_factor))


def test_probe_turns_speculation_back_on_when_it_pays():
    fb = FallbackManager(exit_margin=0.02)
    rules = [SLOWER]
    for t in (0, 10, 20):
        verdict = fb.step("c", rules, SLOW, t, [fb.rules.evaluate(SLOWER, "c", SLOW, t)])
    assert verdict.action == "enter" and fb.is_active("c")
    # probes still slower than plain: stays off
    still_bad = _mixed(0.9, probe_draft_factor=10)
    for t in (30, 40, 50, 60):
        verdict = fb.step("c", rules, still_bad, t, [fb.rules.evaluate(SLOWER, "c", still_bad, t)])
        assert verdict.action == "stay_off"
    # probes pay again: back on at the first window that shows it (no flapping so far)
    good = _mixed(0.9)
    assert good.speedup > 1.02
    verdict = fb.step("c", rules, good, 70, [fb.rules.evaluate(SLOWER, "c", good, 70)])
    assert verdict.action == "exit"
    assert not fb.is_active("c")


def _enter(fb, rules, t0):
    for t in (t0, t0 + 10, t0 + 20):
        verdict = fb.step("c", rules, SLOW, t, [fb.rules.evaluate(SLOWER, "c", SLOW, t)])
    assert verdict.action == "enter"


def _recover(fb, rules, t0, n=5):
    """Windows whose probes pay, one per 10 s from ``t0``: the verdicts up to the exit."""
    good = _mixed(0.9)
    verdicts = []
    for t in range(t0, t0 + 10 * n, 10):
        verdicts.append(fb.step("c", rules, good, t, [fb.rules.evaluate(SLOWER, "c", good, t)]))
        if verdicts[-1].action == "exit":
            break
    return verdicts


def test_a_class_that_flaps_holds_its_next_exit_for_for_s():
    fb = FallbackManager(exit_margin=0.02, flap_window_s=600)
    rules = [SLOWER]
    _enter(fb, rules, 0)
    assert [v.action for v in _recover(fb, rules, 30)] == ["exit"]
    # slower again right after turning back on: the recovery did not last, so the next exit
    # waits until the probes have paid for the rule's for_s (20 s: three windows)
    _enter(fb, rules, 40)
    verdicts = _recover(fb, rules, 70)
    assert [v.action for v in verdicts] == ["stay_off", "stay_off", "exit"]
    assert "within 600s of its last exit" in verdicts[0].reason


def test_a_fallback_long_after_the_last_exit_is_not_flapping():
    fb = FallbackManager(exit_margin=0.02, flap_window_s=600)
    rules = [SLOWER]
    _enter(fb, rules, 0)
    assert [v.action for v in _recover(fb, rules, 30)] == ["exit"]
    _enter(fb, rules, 700)  # 670 s after the exit
    assert [v.action for v in _recover(fb, rules, 730)] == ["exit"]
    # a forced (webhook) fallback soon after an exit counts as flapping too
    fb.force("c", "webhook-rule", "webhook", 740)
    assert [v.action for v in _recover(fb, rules, 750)] == ["stay_off", "stay_off", "exit"]


def test_probe_needs_samples():
    fb = FallbackManager()
    fb.force("c", "slower", "webhook", 0)
    thin = window(0.9, 1, rounds=100)  # 100 drafted < 500
    verdict = fb.step("c", [SLOWER], thin, 100, [fb.rules.evaluate(SLOWER, "c", thin, 100)])
    assert verdict.action == "stay_off" and "500" in verdict.reason


def test_bad_comparison_rejected():
    class Rule:
        name, op, threshold, min_samples, metric = "x", "!=", 1.0, 0, "speedup"
    with pytest.raises(ValueError):
        judge(Rule, "c", FAST)
