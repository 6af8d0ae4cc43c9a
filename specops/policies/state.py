"""The typed records the policy store keeps in Redis: effective settings and rollout state."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

Phase = Literal["progressing", "paused", "healthy", "degraded", "aborted"]
PHASES: tuple[str, ...] = ("progressing", "paused", "healthy", "degraded", "aborted")
ACTIVE_PHASES = frozenset({"progressing", "paused"})


@dataclass(frozen=True)
class EffectiveSettings:
    """What the runtimes apply to one request class right now (read by every pod)."""

    request_class: str
    method: str                 # draft | medusa | ngram | off
    gamma: int
    medusa_heads: int
    tree_size: int
    fallback_active: bool       # speculation turned off by an alert / the controller
    probe_fraction: float       # share of traffic still speculating while fallen back
    revision: int               # policy revision these settings come from
    updated_at: float           # clock() when written

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> EffectiveSettings:
        data = json.loads(raw)
        return cls(**{f.name: data[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class AnalysisRun:
    """One canary analysis result: Successful, Failed or Inconclusive (Argo Rollouts' terms; ``error``:
    an unreachable metric source, as earlier versions recorded it — now Inconclusive)."""

    outcome: Literal["successful", "failed", "inconclusive", "error"]
    at: float
    step_index: int
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutState:
    """The rollout state machine of the canary revision (one at a time).

    ``weight`` is the percent of traffic on ``revision``; the rest stays on
    ``stable_revision``. ``generation`` is set by the store on every write and used
    for compare-and-set, so an operator's abort is never overwritten by a
    controller tick that read the state before it.
    """

    revision: int
    stable_revision: int | None
    step_index: int
    phase: Phase
    weight: int
    message: str = ""
    analysis_runs: list[dict[str, Any]] = field(default_factory=list)
    step_started_at: float = 0.0
    updated_at: float = 0.0
    attempt: int = 0
    """Incremented at every step start and every resume: analysis runs count only within
    one attempt (a fresh AnalysisRun, as Argo Rollouts starts one per step and resume)."""
    generation: int = 0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"unknown rollout phase {self.phase!r} (one of {', '.join(PHASES)})")
        if not 0 <= self.weight <= 100:
            raise ValueError(f"rollout weight must lie in 0..100, got {self.weight}")

    @property
    def active(self) -> bool:
        """A canary is taking (or waiting to take) traffic."""
        return self.phase in ACTIVE_PHASES

    def current_runs(self) -> list[dict[str, Any]]:
        """The analysis runs of the current step and attempt (what the limits apply to)."""
        return [r for r in self.analysis_runs
                if r.get("step_index") == self.step_index and int(r.get("attempt", 0)) == self.attempt]

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("generation")
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes, generation: int = 0) -> RolloutState:
        data = json.loads(raw)
        known = {f.name for f in fields(cls)} - {"generation"}
        return cls(**{k: v for k, v in data.items() if k in known}, generation=generation)
