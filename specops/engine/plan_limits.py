"""The serving engine's planning schedule: when it plans, probes, vetoes and rests.

Planning every step costs host time; never re-measuring what it declined would let one
stale cost reading switch speculation off (or on) for good. These constants set that
balance; `specops.engine.plan_schedule.PlanSchedule` (one per engine) copies them into
attributes that tests and benchmarks may override.
"""

from __future__ import annotations

PROBE_EVERY = 32
"""Declined-speculation steps between two probe steps, where one sequence runs its best
speculative plan anyway (`PlanSchedule.probe_every`; 0: never). A probe pays for speculating where
the plan said no, a draft model's catch-up included, so probes must be rare enough to cost
little at a batch size where speculation hovers around break-even."""
PROBE_BACKOFF_MAX = 8
"""The longest probe period, in units of `PROBE_EVERY`: each probe that confirms the cost model
doubles the period up to this (`PlanSchedule.after_probe`)."""
PROBE_STALE = 0.67
"""A probe whose verify forward cost under this share of the prediction found the cost model
stale: planning resumes at once."""
PLAN_PREFILL_LIMIT = 32
"""Prompt tokens in a step beyond which its sequences do not speculate (`Engine._plan`)."""
FULL_CATCH_UP = 16
"""Draft-cache catch-up tokens charged in full to the step that feeds them (`Engine._candidate`);
a longer catch-up (a request's first drafting round after a long prompt or a pause) is charged
spread over the steps the request has left, since it is paid once for all of them."""
PLAIN_PROBE_EVERY = 24
"""Speculating steps in a row at one batch size after which one step there decodes plainly
(`PlanSchedule.plain_probe_every`; 0: never), so the plain-step cost each plan is compared with
stays measured."""
VETO_STEPS = 256
"""Plain steps at a batch size where speculating was measured to make decoding slower
(`PlanSchedule.veto_steps`; 0: never). The veto spares requests whose speculation is being measured
(`SpecSettings.observed`: a canary's, a fallback probe's), so the acceptance telemetry the
canary analysis and the fallback read never goes blind."""
GUARD_MIN_BATCH = 2
"""The smallest batch size the veto applies to: at batch 1 every step is one request's own plan,
which its acceptance estimate already steers."""
QUIET_AFTER_DECLINE = 7
"""Steps at the same batch size that skip planning after the planner declined speculation.
Another batch size, a probe step or an observed request plans at once."""
QUIET_MAX = 31
"""The longest quiet stretch. A quiet stretch skips planning at the declining plan's batch size
and every larger one (a larger batch only makes a verify dearer); after each further declining
plan in a row at such a size the stretch doubles (7, 15, 31 steps). A plan that speculates, a
probe that found the cost model stale, or a smaller batch than the stretch's starts over at
`QUIET_AFTER_DECLINE`."""
