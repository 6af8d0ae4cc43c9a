"""Canary analysis for a rollout step, with Argo Rollouts' outcomes and limits.

One *run* evaluates the policy's analysis rules (``rollout.analysis.rules``; empty =
all alert rules) on the canary's metric window of every class the rule watches:

* **Failed** — some rule's condition holds on some class (the canary is bad);
* **Error** — no rule failed, but the metric source could not be read for a class;
* **Inconclusive** — nothing failed or errored, but no rule could be evaluated on
  any class (no traffic, too few samples);
* **Successful** — at least one evaluation, all of them passing.

The runs are tallied as Argo Rollouts does, per step and per resume (each is a
fresh AnalysisRun: ``RolloutState.current_runs``): more than ``failure_limit``
failed runs → the rollout is degraded and rolled back to the last good revision;
more than ``inconclusive_limit`` inconclusive runs → the rollout pauses for a
human; more than ``consecutive_error_limit`` errors in a row → the rollout is
degraded and rolled back too, whatever ``failure_limit`` says (Argo Rollouts ends
such an AnalysisRun in phase Error, which aborts the rollout): a metric source that
stays down must not let a canary sit, nor be promoted blind. Fewer errors in a row
never fail a rollout; a successful, failed or inconclusive run resets the count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specops.controller.fallback import INCONCLUSIVE, OK, VIOLATED, judge, rule_applies
from specops.controller.sources import Reading

SUCCESSFUL = "successful"
FAILED = "failed"
INCONCLUSIVE_RUN = "inconclusive"
ERROR = "error"
OUTCOMES = (SUCCESSFUL, FAILED, INCONCLUSIVE_RUN, ERROR)


@dataclass(frozen=True)
class RunResult:
    """The outcome of one analysis run and the evaluations behind it."""

    outcome: str
    message: str
    evaluations: list[dict] = field(default_factory=list)


def run_analysis(rules: list[Any], readings: dict[str, Reading]) -> RunResult:
    """Evaluate ``rules`` on the canary ``readings`` (class -> Reading)."""
    evaluations: list[dict] = []
    failed: list[str] = []
    errors: list[str] = []
    ok = 0
    for request_class, reading in sorted(readings.items()):
        applicable = [r for r in rules if rule_applies(r, request_class)]
        if not applicable:
            continue
        if reading.stats is None and reading.error:
            errors.append(f"{request_class}: {reading.error}")
            evaluations.append({"class": request_class, "outcome": ERROR, "reason": reading.error})
            continue
        for rule in applicable:
            outcome = judge(rule, request_class, reading.stats)
            evaluations.append(outcome.as_dict())
            if outcome.outcome == VIOLATED:
                failed.append(f"{rule.name} on {request_class}: {outcome.reason}")
            elif outcome.outcome == OK:
                ok += 1
            else:
                assert outcome.outcome == INCONCLUSIVE  # judge returns exactly these three
    if failed:
        return RunResult(FAILED, "; ".join(failed), evaluations)
    if errors:
        return RunResult(ERROR, "; ".join(errors), evaluations)
    if ok == 0:
        return RunResult(INCONCLUSIVE_RUN, "no rule could be evaluated (too little canary traffic)", evaluations)
    return RunResult(SUCCESSFUL, f"{ok} evaluations passed", evaluations)


@dataclass(frozen=True)
class Tally:
    successful: int = 0
    failed: int = 0
    inconclusive: int = 0
    errors: int = 0
    consecutive_errors: int = 0


def tally(runs: list[dict]) -> Tally:
    """Count the outcomes of the runs recorded so far (oldest first)."""
    counts = dict.fromkeys(OUTCOMES, 0)
    consecutive = 0
    for run in runs:
        outcome = run.get("outcome")
        if outcome not in counts:
            raise ValueError(f"unknown analysis outcome {outcome!r} in rollout state")
        counts[outcome] += 1
        consecutive = consecutive + 1 if outcome == ERROR else 0
    return Tally(counts[SUCCESSFUL], counts[FAILED], counts[INCONCLUSIVE_RUN], counts[ERROR], consecutive)


@dataclass(frozen=True)
class Verdict:
    """What the rollout must do after a run: ``continue``, ``rollback`` or ``pause``."""

    action: str
    reason: str


def verdict(t: Tally, analysis: Any) -> Verdict:
    """Apply the analysis limits (an :class:`~specops.policies.Analysis`) to a tally."""
    if t.failed > analysis.failure_limit:
        return Verdict("rollback", f"{t.failed} failed runs > limit {analysis.failure_limit}")
    if t.consecutive_errors > analysis.consecutive_error_limit:
        return Verdict("rollback", f"{t.consecutive_errors} consecutive errors > limit "
                                   f"{analysis.consecutive_error_limit} (metric source down)")
    if t.inconclusive > analysis.inconclusive_limit:
        return Verdict("pause", f"{t.inconclusive} inconclusive runs > limit {analysis.inconclusive_limit}")
    return Verdict("continue", f"{t.successful} successful, {t.failed} failed, {t.inconclusive} inconclusive, "
                               f"{t.errors} errors")
