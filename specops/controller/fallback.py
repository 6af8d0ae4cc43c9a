"""Alert-rule evaluation over metric windows, and the per-class fallback state.

A rule is evaluated on a window into one of three outcomes:

* ``violated`` — the metric satisfies the rule's comparison (``speedup < 1``);
* ``ok`` — it does not;
* ``inconclusive`` — no window (source unreachable or empty), fewer drafted tokens
  than ``min_samples``, or a metric the source does not carry. Inconclusive never
  counts as a pass or a failure: a pending rule keeps its start time, but a rule
  only fires on a tick where it was actually evaluated as violated.

Like a Prometheus alert, a rule fires once it has been violated continuously for
``for_s`` seconds (``pending_since`` to now). A firing ``fallback`` rule turns the
class's method ``off``. While off, a ``probe_fraction`` of the class's traffic still
runs speculation; the window then mixes plain requests (speed-up exactly 1) with
probes, so the mixed speed-up is above 1 exactly when the probes are faster than
plain decoding. Speculation is turned back on when the window carries enough drafted
tokens, no fallback rule is violated and the mixed speed-up exceeds ``1 + exit_margin``
— at the first such window (like a Prometheus alert, which resolves at the first
evaluation where its condition no longer holds; the window itself is ``window_s`` of
probe traffic that paid) unless the class *flaps*: one that falls back again within
``flap_window_s`` of its previous exit must see its probes pay for the rule's
``for_s`` before its next exit (the previous, always-on hold), so a recovery that
does not last costs at most that hold per cycle instead of a cycle per window.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}

VIOLATED = "violated"
OK = "ok"
INCONCLUSIVE = "inconclusive"


def metric_value(stats: Any, metric: str) -> float | None:
    """The value of a rule ``metric`` in a window, or None when the window lacks it."""
    if stats is None:
        return None
    value = getattr(stats, metric, None)
    if value is None:
        return None
    if isinstance(value, (list, tuple)):  # per-head accuracy: the weakest head counts
        values = [v for v in value if v is not None]
        return min(values) if values else None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    if value != value:  # NaN: 0/0 in a ratio
        return None
    return value


@dataclass(frozen=True)
class RuleOutcome:
    """One rule on one class's window at one tick."""

    rule: str
    request_class: str
    outcome: str  # violated | ok | inconclusive
    value: float | None
    threshold: float
    op: str
    reason: str
    pending_s: float = 0.0  # how long it has been violated (0 when not pending)
    firing: bool = False

    def as_dict(self) -> dict:
        return {
            "rule": self.rule, "class": self.request_class, "outcome": self.outcome, "value": self.value,
            "op": self.op, "threshold": self.threshold, "pending_s": round(self.pending_s, 3),
            "firing": self.firing, "reason": self.reason,
        }


def judge(rule: Any, request_class: str, stats: Any) -> RuleOutcome:
    """Evaluate ``rule`` (an :class:`~specops.policies.AlertRule`) once, without ``for``."""
    compare = _OPS.get(rule.op)
    if compare is None:
        raise ValueError(f"alert rule {rule.name!r}: unknown comparison {rule.op!r}")
    if stats is None:
        return RuleOutcome(rule.name, request_class, INCONCLUSIVE, None, rule.threshold, rule.op, "no data from metric source")
    drafted = getattr(stats, "drafted", 0) or 0
    if drafted < rule.min_samples:
        return RuleOutcome(rule.name, request_class, INCONCLUSIVE, None, rule.threshold, rule.op,
                           f"{drafted} drafted tokens < min_samples {rule.min_samples}")
    value = metric_value(stats, rule.metric)
    if value is None:
        return RuleOutcome(rule.name, request_class, INCONCLUSIVE, None, rule.threshold, rule.op,
                           f"metric {rule.metric} not available")
    if compare(value, rule.threshold):
        return RuleOutcome(rule.name, request_class, VIOLATED, value, rule.threshold, rule.op,
                           f"{rule.metric}={value:.4g} {rule.op} {rule.threshold:g}")
    return RuleOutcome(rule.name, request_class, OK, value, rule.threshold, rule.op,
                       f"{rule.metric}={value:.4g} not {rule.op} {rule.threshold:g}")


def rule_applies(rule: Any, request_class: str) -> bool:
    classes = getattr(rule, "classes", None)
    return classes is None or request_class in classes


@dataclass
class RuleTracker:
    """``for``-duration bookkeeping across ticks, keyed by (class, rule)."""

    pending_since: dict[tuple[str, str], float] = field(default_factory=dict)

    def evaluate(self, rule: Any, request_class: str, stats: Any, now: float) -> RuleOutcome:
        first = judge(rule, request_class, stats)
        key = (request_class, rule.name)
        if first.outcome == OK:
            self.pending_since.pop(key, None)
            return first
        if first.outcome == INCONCLUSIVE:
            since = self.pending_since.get(key)
            pending = now - since if since is not None else 0.0
            return RuleOutcome(**{**first.__dict__, "pending_s": pending, "firing": False})
        since = self.pending_since.setdefault(key, now)
        pending = now - since
        return RuleOutcome(**{**first.__dict__, "pending_s": pending, "firing": pending >= rule.for_s})

    def forget(self, request_class: str) -> None:
        for key in [k for k in self.pending_since if k[0] == request_class]:
            del self.pending_since[key]


@dataclass
class FallbackState:
    """A class that is currently off."""

    since: float
    rule: str
    reason: str
    recovering_since: float | None = None
    flapped: bool = False  # fell back again soon after its previous exit: the exit holds for for_s


@dataclass(frozen=True)
class FallbackVerdict:
    """What the fallback logic wants for a class this tick."""

    action: str  # "enter" | "exit" | "stay_off" | "stay_on"
    rule: str | None
    reason: str


@dataclass
class FallbackManager:
    """Decides entering and leaving fallback for each class."""

    exit_margin: float = 0.02
    flap_window_s: float = 600.0  # a re-entry this soon after an exit counts as flapping
    rules: RuleTracker = field(default_factory=RuleTracker)
    active: dict[str, FallbackState] = field(default_factory=dict)
    last_exit: dict[str, float] = field(default_factory=dict)  # class -> when its last fallback ended

    def is_active(self, request_class: str) -> bool:
        return request_class in self.active

    def force(self, request_class: str, rule: str, reason: str, now: float) -> bool:
        """Enter fallback from outside (a webhook alert); False if already off."""
        if request_class in self.active:
            return False
        self.active[request_class] = FallbackState(since=now, rule=rule, reason=reason,
                                                   flapped=self._flapping(request_class, now))
        return True

    def _flapping(self, request_class: str, now: float) -> bool:
        last = self.last_exit.get(request_class)
        return last is not None and now - last < self.flap_window_s

    def step(self, request_class: str, fallback_rules: list[Any], stats: Any, now: float,
             outcomes: list[RuleOutcome]) -> FallbackVerdict:
        """Update state from this tick's ``outcomes`` of ``fallback_rules`` (already evaluated)."""
        state = self.active.get(request_class)
        if state is None:
            firing = [o for o in outcomes if o.firing]
            if firing:
                self.active[request_class] = FallbackState(since=now, rule=firing[0].rule, reason=firing[0].reason,
                                                           flapped=self._flapping(request_class, now))
                self.rules.forget(request_class)
                return FallbackVerdict("enter", firing[0].rule, f"{firing[0].rule} firing: {firing[0].reason}")
            return FallbackVerdict("stay_on", None, "no fallback rule firing")
        pays, why = self._probes_pay(fallback_rules, stats, outcomes)
        if not pays:
            state.recovering_since = None
            return FallbackVerdict("stay_off", state.rule, f"probes: {why}")
        if state.recovering_since is None:
            state.recovering_since = now
        hold = max((r.for_s for r in fallback_rules), default=0.0) if state.flapped else 0.0
        held = now - state.recovering_since
        if held < hold:
            return FallbackVerdict("stay_off", state.rule,
                                   f"probes pay ({why}) for {held:.0f}s < {hold:.0f}s (fell back again within "
                                   f"{self.flap_window_s:.0f}s of its last exit)")
        del self.active[request_class]
        self.rules.forget(request_class)
        self.last_exit[request_class] = now
        return FallbackVerdict("exit", state.rule, f"probes pay again: {why}")

    def _probes_pay(self, fallback_rules: list[Any], stats: Any, outcomes: list[RuleOutcome]) -> tuple[bool, str]:
        if stats is None:
            return False, "no data from metric source"
        need = max((r.min_samples for r in fallback_rules), default=1)
        drafted = getattr(stats, "drafted", 0) or 0
        if drafted < max(need, 1):
            return False, f"{drafted} probe drafted tokens < {max(need, 1)}"
        bad = [o for o in outcomes if o.outcome != OK]
        if bad:
            return False, f"{bad[0].rule} {bad[0].outcome}: {bad[0].reason}"
        speedup = metric_value(stats, "speedup")
        if speedup is None:
            return False, "speed-up not available"
        if speedup <= 1.0 + self.exit_margin:
            return False, f"mixed speed-up {speedup:.3f} <= {1.0 + self.exit_margin:.3f}"
        return True, f"mixed speed-up {speedup:.3f}"
