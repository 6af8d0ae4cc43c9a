from specops.controller.analysis import run_analysis, tally, verdict
from specops.controller.sources import Reading
from specops.policies import AlertRule, Analysis
from tests.controller.helpers import window

RULE = AlertRule(name="slower", metric="speedup", op="<", threshold=1.0, min_samples=100, action="rollback")
GOOD, BAD = window(0.9, 4), window(0.9, 4, draft_factor=10)


def test_outcomes():
    assert run_analysis([RULE], {"a": Reading(GOOD), "b": Reading(GOOD)}).outcome == "successful"
    assert run_analysis([RULE], {"a": Reading(GOOD), "b": Reading(BAD)}).outcome == "failed"
    assert run_analysis([RULE], {"a": Reading(GOOD), "b": Reading(None, "redis down")}).outcome == "error"
    assert run_analysis([RULE], {"a": Reading(None), "b": Reading(None)}).outcome == "inconclusive"
    thin = window(0.9, 4, rounds=10)
    assert run_analysis([RULE], {"a": Reading(thin)}).outcome == "inconclusive"
    # failure wins over errors; an empty class beside a passing one is still successful
    assert run_analysis([RULE], {"a": Reading(BAD), "b": Reading(None, "x")}).outcome == "failed"
    assert run_analysis([RULE], {"a": Reading(GOOD), "b": Reading(None)}).outcome == "successful"


def runs(*outcomes):
    return [{"outcome": o} for o in outcomes]


def test_limits():
    strict = Analysis(failure_limit=0, inconclusive_limit=1, consecutive_error_limit=2)
    assert verdict(tally(runs("successful")), strict).action == "continue"
    assert verdict(tally(runs("successful", "failed")), strict).action == "rollback"
    lenient = Analysis(failure_limit=1, inconclusive_limit=1, consecutive_error_limit=2)
    assert verdict(tally(runs("failed")), lenient).action == "continue"
    assert verdict(tally(runs("failed", "successful", "failed")), lenient).action == "rollback"
    assert verdict(tally(runs("inconclusive")), strict).action == "continue"
    assert verdict(tally(runs("inconclusive", "inconclusive")), strict).action == "pause"
    # errors: only consecutive ones beyond the limit count as a failure
    assert verdict(tally(runs("error", "error", "successful", "error", "error")), strict).action == "continue"
    v = verdict(tally(runs("error", "error", "error")), strict)
    assert v.action == "rollback" and "consecutive" in v.reason
