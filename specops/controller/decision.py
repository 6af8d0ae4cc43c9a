"""What the controller decided for a class (or the rollout) in a tick: the record its audit
entries, logs and decision history are made of."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Decision:
    """One thing the controller decided for a class (or the rollout) in a tick."""

    request_class: str | None
    kind: str  # adapt | hold | inconclusive | fallback_on | fallback_off | alert | seed | rollout.*
    reason: str
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.kind not in ("hold", "inconclusive")

    def as_dict(self) -> dict[str, Any]:
        return {"class": self.request_class, "kind": self.kind, "reason": self.reason, "before": self.before,
                "after": self.after, "inputs": self.inputs}
