"""Canary analysis for a rollout step, with Argo Rollouts' outcomes and limits.

One *run* evaluates the policy's analysis rules (``rollout.analysis.rules``; empty =
all alert rules) on the canary's metric window of every class the rule watches:

* **Failed** — some rule's condition holds on some class (the canary is bad);
* **Inconclusive** — nothing failed, and no rule could be evaluated on any class
  (no traffic, too few samples), *or* the metric source could not be read for a
  class (Prometheus or Redis unreachable: the run is marked ``unreachable``);
* **Successful** — at least one evaluation, all of them passing, and every source
  answered.

A metric source that is down says nothing about the canary, so it is never a
failure: an unreachable run is Inconclusive, as Argo Rollouts treats a measurement
it cannot judge (its Inconclusive phase pauses a rollout). The runs are tallied per
step and per resume (each is a fresh AnalysisRun: ``RolloutState.current_runs``):

* more than ``failure_limit`` failed runs → ``rollback`` (degraded, traffic back on
  the last good revision);
* the latest run unreachable → ``hold``: the step does not advance (nothing is
  promoted on missing data) and nothing is rolled back; the next run tries again;
* more than ``consecutive_error_limit`` unreachable runs in a row → ``pause``: the
  rollout stays paused, saying why, until an operator promotes or aborts it. (Argo
  Rollouts ends such an AnalysisRun in Error, which aborts the rollout; specops does
  not roll back on a monitoring outage — a false rollback is a release lost for
  nothing, and the canary's traffic share is unchanged while it waits.)
* more than ``inconclusive_limit`` inconclusive runs *with data missing for lack of
  traffic* → ``pause`` too.

Runs recorded with outcome ``error`` by earlier versions read as unreachable
Inconclusive runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specops.controller.fallback import INCONCLUSIVE, OK, VIOLATED, judge, rule_applies
from specops.controller.sources import Reading

SUCCESSFUL = "successful"
FAILED = "failed"
INCONCLUSIVE_RUN = "inconclusive"
OUTCOMES = (SUCCESSFUL, FAILED, INCONCLUSIVE_RUN)
LEGACY_ERROR = "error"  # written by earlier versions for an unreachable source; read as unreachable Inconclusive


@dataclass(frozen=True)
class RunResult:
    """The outcome of one analysis run and the evaluations behind it.

    ``unreachable``: the run is Inconclusive because a metric source could not be read.
    """

    outcome: str
    message: str
    evaluations: list[dict] = field(default_factory=list)
    unreachable: bool = False

    def as_run(self) -> dict[str, Any]:
        """The record stored in the rollout state (``record_analysis``)."""
        run = {"outcome": self.outcome, "message": self.message[:500], "evaluations": self.evaluations}
        if self.unreachable:
            run["unreachable"] = True
        return run


def run_analysis(rules: list[Any], readings: dict[str, Reading]) -> RunResult:
    """Evaluate ``rules`` on the canary ``readings`` (class -> Reading)."""
    evaluations: list[dict] = []
    failed: list[str] = []
    unreachable: list[str] = []
    ok = 0
    for request_class, reading in sorted(readings.items()):
        applicable = [r for r in rules if rule_applies(r, request_class)]
        if not applicable:
            continue
        if reading.stats is None and reading.error:
            unreachable.append(f"{request_class}: {reading.error}")
            evaluations.append({"class": request_class, "outcome": INCONCLUSIVE, "reason": reading.error,
                                "unreachable": True})
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
    if unreachable:
        return RunResult(INCONCLUSIVE_RUN, "metric source unreachable: " + "; ".join(unreachable), evaluations,
                         unreachable=True)
    if ok == 0:
        return RunResult(INCONCLUSIVE_RUN, "no rule could be evaluated (too little canary traffic)", evaluations)
    return RunResult(SUCCESSFUL, f"{ok} evaluations passed", evaluations)


def is_unreachable(run: dict) -> bool:
    """An Inconclusive run whose metric source could not be read (or a legacy ``error`` run)."""
    return run.get("outcome") == LEGACY_ERROR or (run.get("outcome") == INCONCLUSIVE_RUN and bool(run.get("unreachable")))


@dataclass(frozen=True)
class Tally:
    successful: int = 0
    failed: int = 0
    inconclusive: int = 0
    """Inconclusive for lack of data (no or too little canary traffic)."""
    unreachable: int = 0
    """Inconclusive because a metric source could not be read."""
    consecutive_unreachable: int = 0
    """Unreachable runs at the end of the list, in a row."""


def tally(runs: list[dict]) -> Tally:
    """Count the outcomes of the runs recorded so far (oldest first)."""
    counts = dict.fromkeys(OUTCOMES, 0)
    unreachable = consecutive = 0
    for run in runs:
        outcome = run.get("outcome")
        if is_unreachable(run):
            unreachable += 1
            consecutive += 1
            continue
        if outcome not in counts:
            raise ValueError(f"unknown analysis outcome {outcome!r} in rollout state")
        counts[outcome] += 1
        consecutive = 0
    return Tally(counts[SUCCESSFUL], counts[FAILED], counts[INCONCLUSIVE_RUN], unreachable, consecutive)


@dataclass(frozen=True)
class Verdict:
    """What the rollout must do after a run: ``continue``, ``hold`` (stay at this step, run again),
    ``pause`` (phase paused until an operator acts) or ``rollback``."""

    action: str
    reason: str


def verdict(t: Tally, analysis: Any) -> Verdict:
    """Apply the analysis limits (an :class:`~specops.policies.Analysis`) to a tally."""
    if t.failed > analysis.failure_limit:
        return Verdict("rollback", f"{t.failed} failed runs > limit {analysis.failure_limit}")
    if t.consecutive_unreachable > analysis.consecutive_error_limit:
        return Verdict("pause", f"metric source unreachable for {t.consecutive_unreachable} consecutive runs > limit "
                                f"{analysis.consecutive_error_limit}; neither promoted nor rolled back on missing "
                                "data: promote to resume, abort to stop")
    if t.inconclusive > analysis.inconclusive_limit:
        return Verdict("pause", f"{t.inconclusive} inconclusive runs > limit {analysis.inconclusive_limit}")
    if t.consecutive_unreachable:
        return Verdict("hold", f"metric source unreachable ({t.consecutive_unreachable} run(s) in a row, limit "
                               f"{analysis.consecutive_error_limit}): holding at this step")
    return Verdict("continue", f"{t.successful} successful, {t.failed} failed, {t.inconclusive} inconclusive, "
                               f"{t.unreachable} unreachable")
