import pytest

from specops.controller.analysis import run_analysis, tally, verdict
from specops.controller.sources import Reading
from specops.policies import AlertRule, Analysis
from tests.controller.helpers import window

RULE = AlertRule(name="slower", metric="speedup", op="<", threshold=1.0, min_samples=100, action="rollback")
GOOD, BAD = window(0.9, 4), window(0.9, 4, draft_factor=10)


def test_outcomes():
    assert run_analysis([RULE], {"a": Reading(GOOD), "b": Reading(GOOD)}).outcome == "successful"
    assert run_analysis([RULE], {"a": Reading(GOOD), "b": Reading(BAD)}).outcome == "failed"
    down = run_analysis([RULE], {"a": Reading(GOOD), "b": Reading(None, "prometheus query failed: refused")})
    assert (down.outcome, down.unreachable) == ("inconclusive", True) and "unreachable" in down.message
    assert down.as_run()["unreachable"] is True and "unreachable" not in run_analysis([RULE], {}).as_run()
    assert run_analysis([RULE], {"a": Reading(None), "b": Reading(None)}).outcome == "inconclusive"
    thin = window(0.9, 4, rounds=10)
    assert run_analysis([RULE], {"a": Reading(thin)}).outcome == "inconclusive"
    # a failure wins over an unreachable class; an empty class beside a passing one is still successful
    assert run_analysis([RULE], {"a": Reading(BAD), "b": Reading(None, "x")}).outcome == "failed"
    assert run_analysis([RULE], {"a": Reading(GOOD), "b": Reading(None)}).outcome == "successful"


def runs(*outcomes):
    """Run records; ``down`` is an Inconclusive run whose metric source was unreachable."""
    return [{"outcome": "inconclusive", "unreachable": True} if o == "down" else {"outcome": o} for o in outcomes]


def test_limits():
    strict = Analysis(failure_limit=0, inconclusive_limit=1, consecutive_error_limit=2)
    assert verdict(tally(runs("successful")), strict).action == "continue"
    assert verdict(tally(runs("successful", "failed")), strict).action == "rollback"
    lenient = Analysis(failure_limit=1, inconclusive_limit=1, consecutive_error_limit=2)
    assert verdict(tally(runs("failed")), lenient).action == "continue"
    assert verdict(tally(runs("failed", "successful", "failed")), lenient).action == "rollback"
    assert verdict(tally(runs("inconclusive")), strict).action == "continue"
    assert verdict(tally(runs("inconclusive", "inconclusive")), strict).action == "pause"


def test_unreachable_source_holds_then_pauses_and_never_rolls_back():
    strict = Analysis(failure_limit=0, inconclusive_limit=0, consecutive_error_limit=2)
    # the latest run unreachable: hold (no promotion), whatever ran before
    assert verdict(tally(runs("successful", "down")), strict).action == "hold"
    assert verdict(tally(runs("down", "down")), strict).action == "hold"
    # a successful run after an outage ends the hold; unreachable runs are not "no traffic" inconclusives
    assert verdict(tally(runs("down", "down", "successful", "down", "successful")), strict).action == "continue"
    v = verdict(tally(runs("successful", "down", "down", "down")), strict)
    assert v.action == "pause" and "unreachable for 3 consecutive runs" in v.reason
    # any number of unreachable runs never rolls back; a real failure still does
    assert verdict(tally(runs(*["down"] * 50)), strict).action == "pause"
    assert verdict(tally(runs("down", "failed")), strict).action == "rollback"
    t = tally(runs("successful", "down", "inconclusive", "down", "down"))
    assert (t.successful, t.inconclusive, t.unreachable, t.consecutive_unreachable) == (1, 1, 3, 2)


def test_runs_recorded_as_error_by_earlier_versions_read_as_unreachable():
    strict = Analysis(failure_limit=0, inconclusive_limit=0, consecutive_error_limit=1)
    assert verdict(tally(runs("error")), strict).action == "hold"
    assert verdict(tally(runs("error", "down")), strict).action == "pause"
    with pytest.raises(ValueError, match="unknown analysis outcome"):
        tally(runs("exploded"))
