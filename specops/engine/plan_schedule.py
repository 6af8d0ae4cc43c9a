"""When the serving engine plans speculation, and when it overrides what a plan said.

`PlanSchedule` holds the state around the planner (`specops.engine.spec_planner.plan`),
kept out of the engine so the step reads as schedule → plan → propose → verify → commit:

* **veto** — where the last speculative steps at a batch size (≥ `GUARD_MIN_BATCH`) emitted
  fewer tokens per second than its plain steps, its requests decode plainly for
  ``veto_steps`` steps, then it judges afresh; requests marked `SpecSettings.observed` are
  spared (they speculate as set);
* **plain probes** — every ``plain_probe_every``-th step at a batch size that has only
  speculated decodes plainly, so the plain-step cost plans are compared with stays measured;
* **quiet stretches** — after a plan declined speculation, the next ``quiet_after_decline``
  steps at that batch size or a larger one skip planning (a larger batch only makes a verify
  dearer); each further decline in a row doubles the stretch up to ``quiet_max``;
* **probes** — every ``probe_every``-th declined step one sequence runs its best plan anyway,
  so a cost measured in a load spike (or acceptance that has recovered) cannot switch
  speculation off for good; a probe that confirms the decline doubles the period (up to
  `PROBE_BACKOFF_MAX` times), one that finds the cost model stale resets it.

Each period set to 0 turns its mechanism off. Constants: `specops.engine.plan_limits`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specops.engine.plan_limits import (GUARD_MIN_BATCH, PLAIN_PROBE_EVERY, PROBE_BACKOFF_MAX, PROBE_EVERY,
                                         PROBE_STALE, QUIET_AFTER_DECLINE, QUIET_MAX, VETO_STEPS)


class PlanSchedule:
    """The veto, plain-probe, quiet-stretch and probe state of one engine (module docstring)."""

    def __init__(self) -> None:
        self.probe_every = PROBE_EVERY
        self.plain_probe_every = PLAIN_PROBE_EVERY
        self.veto_steps = VETO_STEPS
        self.quiet_after_decline = QUIET_AFTER_DECLINE
        self.quiet_max = QUIET_MAX  # equal to quiet_after_decline: no back-off
        self.declined = 0  # declined steps since the last probe
        self.probe_backoff = 1  # the probe period in units of probe_every (`after_probe`)
        self.probing = False  # this step is a probe
        self.quiet = (0, 0)  # (steps left, batch size): planning skipped there and above after a declined plan
        self.quiet_next = 0  # the last quiet stretch granted
        self.quiet_size = 0  # the smallest batch size of the declines in a row behind it (0: none)
        self.spec_run: dict[int, int] = {}  # batch size -> speculating steps in a row there
        self.veto: dict[int, int] = {}  # batch size -> plain steps left
        self.probes = 0  # probe steps run
        self.plain_probes = 0
        self.vetoes = 0

    # -- before planning -------------------------------------------------------------------
    def vetoed(self, b: int, calibration: Any) -> bool:
        """Whether batch size ``b`` is under a veto this step (counting the step down; the
        calibration forgets its speculative record when the veto ends)."""
        if self.veto.get(b, 0) <= 0:
            return False
        self.veto[b] -= 1
        if not self.veto[b] and calibration is not None:
            calibration.forget_spec(b)
        return True

    def skip(self, b: int, observed: bool) -> bool:
        """Whether a step of ``b`` sequences decodes plainly without planning: a plain probe's
        turn, or a quiet stretch (unless a request is observed or a probe is due)."""
        if self.plain_probe_every and self.spec_run.get(b, 0) >= self.plain_probe_every:
            self.spec_run[b] = 0
            self.plain_probes += 1
            return True
        left, size = self.quiet
        if left > 0 and b >= size and not observed and not self.probe_due(self.declined + 1):
            # the plan at this batch size (or a smaller one) just declined: nothing it reads has moved
            # but the plain steps' drift, so the next few steps skip it; a probe step, or a smaller
            # batch, plans again
            self.quiet = (left - 1, size)
            self.declined += 1
            return True
        return False

    # -- after planning --------------------------------------------------------------------
    def planned(self, b: int, offered: bool, speculates: bool) -> bool:
        """Record a plan at batch size ``b`` (``offered``: it weighed real proposals;
        ``speculates``: it chose to speculate); True when this step must probe instead."""
        if offered and not speculates:
            # declined again at the last stretch's batch size or a larger one: the next is twice as long
            shortest = self.quiet_after_decline
            again = 0 < self.quiet_size <= b and shortest > 0
            self.quiet_next = min(2 * self.quiet_next + 1, max(self.quiet_max, shortest)) if again else shortest
            self.quiet_size = min(self.quiet_size, b) if again else b
            self.quiet = (self.quiet_next, self.quiet_size)
        else:
            # plan again next step; a plan that speculates also ends the declines in a row (one with
            # nothing to weigh, no n-gram match now, leaves them as they are)
            self.quiet = (0, 0)
            if speculates:
                self.quiet_size = 0
        self.spec_run[b] = self.spec_run.get(b, 0) + 1 if speculates else 0
        if speculates:
            self.probe_backoff = 1
            return False
        if not self.probe_every:
            return False
        self.declined += 1
        return self.probe_due(self.declined)

    def probed(self, ran: bool) -> None:
        """A probe step was chosen (``ran``: it really speculates)."""
        self.probes += 1
        self.declined = 0
        self.probing = ran

    def probe_due(self, declined: int) -> bool:
        """Whether a step after ``declined`` declined ones since the last probe is a probe step
        (``probe_every``, stretched by the back-off: see `after_probe`)."""
        return bool(self.probe_every) and declined >= self.probe_every * self.probe_backoff

    def after_probe(self, predicted_s: float, forward_s: float) -> None:
        """A probe whose verify forward cost about what the model predicted (``predicted_s``)
        confirms the decline: the next one waits twice as long. One that cost under
        `PROBE_STALE` of it found the model stale (a cost measured in a load spike): the short
        period stays and planning resumes at once."""
        self.probing = False
        stale = forward_s < PROBE_STALE * predicted_s
        self.probe_backoff = 1 if stale else min(self.probe_backoff * 2, PROBE_BACKOFF_MAX)
        if stale:
            self.quiet, self.quiet_size = (0, 0), 0

    # -- after a speculative step ----------------------------------------------------------
    def judge(self, b: int, losing: Callable[[int], bool]) -> None:
        """Start a veto at batch size ``b`` when ``losing(b)`` says its speculative steps emit
        fewer tokens per second than its plain ones (asked only from `GUARD_MIN_BATCH` on, with
        ``veto_steps`` > 0 and no veto running there)."""
        if b >= GUARD_MIN_BATCH and self.veto_steps and not self.veto.get(b) and losing(b):
            self.veto[b] = self.veto_steps
            self.vetoes += 1
