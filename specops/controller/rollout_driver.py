"""The controller's side of a canary rollout: run the analysis, act on its verdict.

The state machine itself (steps, weights, promote/abort/fail/pause/rollback) is
``specops.policies.rollout``; this module decides *when* to call it:

* every ``analysis.interval_s`` during a progressing step with ``analysis: true``,
  evaluate the canary's windows (:func:`~specops.controller.analysis.run_analysis`)
  and record the run;
* tally the runs of the current step and attempt with the new one and apply the
  limits (:func:`~specops.controller.analysis.verdict`): the run and its consequence —
  degraded (traffic back on the stable revision) or paused — are ONE write
  (``record_analysis(then=...)``), so a failed run is never on record without it; a
  run the metric source could not answer (Prometheus down) is Inconclusive and holds
  the step: never a promotion, never a rollback;
* otherwise advance to the next step once its pause is over (``advance_if_due``),
  re-checking the verdict on exactly the state that is advanced;
* a firing alert with action ``rollback`` fails an active canary at once, or — with
  no canary — rolls the policy back to the previously current revision, once per
  revision it was decided against (:meth:`RolloutDriver.rollback_now`).

Canary traffic must be measurable apart from stable traffic: runtimes serving the
canary revision publish their telemetry under :func:`canary_namespace` and the
controller reads it through ``canary_source``. Without one the analysis is
Inconclusive (never a pass).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from specops.controller.analysis import run_analysis, tally, verdict
from specops.controller.decision import Decision
from specops.controller.fallback import rule_applies
from specops.controller.sources import MetricSource, Reading, read_many
from specops.policies import rollout as machine
from specops.policies.errors import ConflictError, CurrentChangedError, StateError

log = logging.getLogger(__name__)


def canary_namespace(namespace: str = "specops") -> str:
    """Telemetry namespace for traffic served by the canary revision."""
    return f"{namespace}:canary"


class RolloutDriver:
    """Drives the rollout state machine from controller ticks."""

    def __init__(self, store, canary_source: MetricSource | None, clock: Callable[[], float], metrics) -> None:
        self.store = store
        self.canary_source = canary_source
        self.clock = clock
        self.metrics = metrics

    def _decision(self, kind: str, reason: str, **inputs: Any) -> Decision:
        return Decision(None, kind, reason, inputs=inputs)

    def tick(self, stable_policy: Any, epoch: Any, rollback_alerts: list, state: Any = None) -> list:
        state = state if state is not None else self.store.rollout_state()
        if rollback_alerts:
            rules = sorted({o.rule for o in rollback_alerts})
            return self.rollback_now(stable_policy, epoch, f"alert {', '.join(rules)} firing", state=state,
                                     against=self.store.current_revision())
        if state is None or state.phase != "progressing":
            return []
        canary = self.store.get_revision(state.revision).policy
        analysis = canary.rollout.analysis
        step = canary.rollout.steps[state.step_index]
        decisions = []
        now = self.clock()
        if step.analysis:
            runs_here = state.current_runs()
            last = max((r.get("at", 0.0) for r in runs_here), default=None)
            if last is not None and now - last < analysis.interval_s:
                standing = self._enforce(state, analysis, epoch)  # a verdict on record whose consequence never landed
                if standing:
                    return standing
            else:
                rules = canary.analysis_rules()  # only the classes some rule watches are read
                classes = [c for c in canary.class_names if any(rule_applies(r, c) for r in rules)]
                result = run_analysis(rules, self._canary_readings(classes, analysis.window_s))
                self.metrics.analysis_runs.labels(result.outcome).inc()
                run = result.as_run()
                v = verdict(tally([*runs_here, run]), analysis)
                then = "continue" if v.action == "hold" else v.action  # a hold changes nothing but the record
                try:
                    state = machine.record_analysis(self.store, run, epoch=epoch, then=then, reason=v.reason,
                                                    expect_generation=state.generation)
                except ConflictError as exc:
                    log.info("rollout changed while analysing (%s); next tick retries", exc)
                    return decisions
                decisions.append(self._decision("rollout.analysis", f"{result.outcome}: {result.message}",
                                                revision=state.revision, step_index=state.step_index))
                if v.action == "rollback":
                    self.metrics.rollbacks.labels("analysis").inc()
                    decisions.append(self._decision("rollout.rollback", v.reason, revision=state.revision,
                                                    stable_revision=state.stable_revision))
                    return decisions
                if v.action == "pause":
                    decisions.append(self._decision("rollout.pause", v.reason, revision=state.revision))
                    return decisions
                if v.action == "hold":  # no promotion on missing data; the next run tries again
                    decisions.append(self._decision("rollout.hold", v.reason, revision=state.revision,
                                                    step_index=state.step_index))
                    return decisions
        try:
            advanced = machine.advance_if_due(self.store, epoch=epoch, gate=self._gate)
        except ConflictError as exc:
            log.info("rollout changed while advancing (%s); next tick retries", exc)
            return decisions
        if advanced is not None:
            decisions.append(self._decision("rollout.step", advanced.message, revision=advanced.revision,
                                            step_index=advanced.step_index, weight=advanced.weight))
        return decisions

    def _enforce(self, state: Any, analysis: Any, epoch: Any) -> list:
        """Apply the verdict of the runs on record (e.g. written by an older controller without their consequence)."""
        v = verdict(tally(state.current_runs()), analysis)
        if v.action in ("continue", "hold"):
            return []
        try:
            if v.action == "rollback":
                machine.fail(self.store, reason=f"analysis: {v.reason}", epoch=epoch,
                             expect_generation=state.generation)
                self.metrics.rollbacks.labels("analysis").inc()
                return [self._decision("rollout.rollback", v.reason, revision=state.revision,
                                       stable_revision=state.stable_revision)]
            machine.pause(self.store, reason=f"analysis: {v.reason}", epoch=epoch)
            return [self._decision("rollout.pause", v.reason, revision=state.revision)]
        except ConflictError as exc:
            log.info("rollout changed while applying its analysis verdict (%s); next tick retries", exc)
            return []

    @staticmethod
    def _gate(state: Any, canary: Any) -> str | None:
        """Refuse to advance unless the analysis of this step and attempt says continue."""
        v = verdict(tally(state.current_runs()), canary.rollout.analysis)
        if v.action != "continue":
            log.log(logging.INFO if v.action == "hold" else logging.WARNING,
                    "rollout of revision %s not advanced: analysis says %s (%s)", state.revision, v.action, v.reason)
            return v.reason
        return None

    def _canary_readings(self, classes: list[str], window_s: float) -> dict[str, Reading]:
        if self.canary_source is None:
            return {c: Reading(None) for c in classes}
        return read_many(self.canary_source, classes, window_s)

    def rollback_now(self, stable_policy: Any, epoch: Any, reason: str, *, state: Any = None,
                     against: int | None = None, since: float | None = None) -> list:
        """Fail an active canary, or roll back to the previously current revision — once.

        ``state``: the rollout state the decision was taken on (the canary is failed only
        if it is still that one). ``against``: the revision judged bad; the rollback is a
        compare-and-set on it, so a repeated request (the same rule via tick and webhook,
        a restart, a failover) finds it already done and changes nothing. ``since``: when
        the alert started firing; a canary stopped after that already answered it.
        """
        state = state if state is not None else self.store.rollout_state()
        try:
            if state is not None and state.active:
                machine.fail(self.store, reason=reason, epoch=epoch, expect_generation=state.generation)
                self.metrics.rollbacks.labels("alert").inc()
                return [self._decision("rollout.rollback", reason, revision=state.revision,
                                       stable_revision=state.stable_revision)]
            if since is not None and state is not None and state.phase in ("degraded", "aborted") \
                    and state.updated_at >= since:
                raise CurrentChangedError(state.revision, state.stable_revision)
            new = machine.rollback(self.store, epoch=epoch, actor="controller", reason=reason, expect_current=against)
        except (CurrentChangedError, ConflictError) as exc:
            log.info("rollback requested (%s) but already done or overtaken: %s", reason, exc)
            self.store.append_audit({"kind": "rollback.skipped", "reason": reason, "why": f"already done: {exc}",
                                     "against_revision": against}, epoch=epoch)
            return [self._decision("rollout.rollback_skipped", f"{reason}: already done ({exc})")]
        except StateError as exc:
            log.warning("rollback requested (%s) but impossible: %s", reason, exc)
            self.store.append_audit({"kind": "rollback.skipped", "reason": reason, "why": str(exc)}, epoch=epoch)
            return [self._decision("rollout.rollback_skipped", f"{reason}: {exc}")]
        self.metrics.rollbacks.labels("alert").inc()
        return [self._decision("rollout.rollback", reason, to_revision=new.revision, from_revision=against)]
