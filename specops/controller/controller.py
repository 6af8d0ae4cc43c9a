"""The control loop: one ``tick()`` reads every class's metric window and acts.

Per class and tick (see issue 4 §4):

1. read the class's window from the metric source (one round trip for all classes);
   no data → inconclusive: nothing changes, and nothing counts as pass or failure;
2. evaluate the policy's alert rules with their ``for`` durations; a firing
   ``fallback`` rule turns speculation off for the class (``fallback_active``, with
   ``probe_fraction`` of traffic still speculating); probes that pay again turn it
   back on; a firing ``rollback`` rule rolls an active canary back;
3. otherwise adapt the knob (γ for draft/ngram, heads for medusa) by the class's
   ``adaptation.mode``, guarded by dead-band, cooldown and max step.

All changes of a tick are written in ONE fenced store commit (with the inputs that
led to them, which the store appends to the audit stream); rollout analysis runs
through :class:`~specops.controller.rollout_driver.RolloutDriver`. The controller
acts only while it holds the leader lease (when one is given), and every write
carries the lease's fencing epoch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from specops.controller.adapt import BanditState, Guard, guarded_step, propose_bandit, propose_goodput
from specops.controller.fallback import FallbackManager, RuleOutcome
from specops.controller.metrics import ControllerMetrics
from specops.controller.rollout_driver import RolloutDriver
from specops.controller.sources import MetricSource, Reading, read_many
from specops.policies.errors import ConflictError, StaleEpochError
from specops.policies.state import EffectiveSettings

log = logging.getLogger(__name__)


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


def knob_name(method: str) -> str:
    """The knob adapted for a method: ``medusa_heads`` for medusa, ``gamma`` otherwise."""
    return "medusa_heads" if method == "medusa" else "gamma"


def window_inputs(stats: Any) -> dict[str, Any]:
    """The few window figures recorded with a decision (the audit's "inputs")."""
    if stats is None:
        return {}
    keys = ("requests", "new_tokens", "drafted", "accepted", "acceptance_rate", "speedup", "tokens_per_s", "gamma")
    out: dict[str, Any] = {}
    for k in keys:
        v = getattr(stats, k, None)
        out[k] = round(v, 4) if isinstance(v, float) else v
    out["accepted_per_pos"] = list(getattr(stats, "accepted_per_pos", []))[:16]
    return out


class Controller:
    """The adaptive controller; see the module docstring."""

    def __init__(self, store, sources: MetricSource, policy_provider: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.time, registry=None, lease=None, *,
                 window_s: float = 30.0, canary_source: MetricSource | None = None,
                 exit_margin: float = 0.02) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.store = store
        self.source = sources
        self.policy_provider = policy_provider or store.current_policy
        self.clock = clock
        self.metrics = ControllerMetrics(registry)
        self.lease = lease
        self.window_s = window_s
        self.fallback = FallbackManager(exit_margin=exit_margin)
        self.bandits: dict[str, BanditState] = {}
        self.rollout = RolloutDriver(store, canary_source, clock, self.metrics)
        self._lock = threading.Lock()
        self._rollback_fired: set[tuple[str, str]] = set()
        self.last_tick_s: float = 0.0

    # ------------------------------------------------------------------ leadership
    @property
    def epoch(self) -> int | None:
        return self.lease.epoch if self.lease is not None else None

    def _lead(self) -> bool:
        if self.lease is None:
            return True
        ok = self.lease.renew() if self.lease.is_leader else self.lease.try_acquire()
        self.metrics.is_leader.set(1 if ok else 0)
        return bool(ok)

    # ------------------------------------------------------------------ tick
    def tick(self) -> list[Decision]:
        """One pass over all classes; returns every decision (holds included)."""
        started = time.perf_counter()
        with self._lock:
            try:
                if not self._lead():
                    log.debug("not the leader: tick skipped")
                    return []
                decisions = self._tick()
            except ConflictError as exc:
                log.info("state changed concurrently, tick abandoned (next tick retries): %s", exc)
                return []
            except StaleEpochError as exc:
                log.warning("lost leadership mid-tick, nothing written: %s", exc)
                self.metrics.is_leader.set(0)
                return []
            finally:
                self.last_tick_s = time.perf_counter() - started
                self.metrics.tick_seconds.observe(self.last_tick_s)
        for d in decisions:
            self.metrics.decisions.labels(d.request_class or "-", d.kind).inc()
        return decisions

    def _tick(self) -> list[Decision]:
        policy = self.policy_provider()
        if policy is None:
            log.info("no current policy revision: nothing to control")
            return []
        now = self.clock()
        revision = self.store.current_revision() or 0
        settings = self.store.effective()
        names = policy.class_names
        readings = read_many(self.source, names, self.window_s)
        decisions: list[Decision] = []
        changed: dict[str, EffectiveSettings] = {}
        rollback_alerts: list[RuleOutcome] = []
        for name in names:
            rc = policy.get_class(name)
            current = settings.get(name)
            if current is None or current.revision != revision:
                seeded = self._seed(rc, revision, now)
                changed[name] = seeded
                decisions.append(Decision(name, "seed", f"settings from policy revision {revision}",
                                          before=_knobs(current), after=_knobs(seeded)))
                continue
            decision, new = self._class_tick(policy, rc, current, readings.get(name, Reading(None)), now,
                                             rollback_alerts)
            decisions.append(decision)
            if new is not None:
                changed[name] = new
        if changed:
            self.store.set_effective(changed, epoch=self.epoch, reason=_summary(decisions),
                                     inputs={d.request_class: {"kind": d.kind, "reason": d.reason, **d.inputs}
                                             for d in decisions if d.changed and d.request_class})
        for name in names:
            active = self.fallback.is_active(name)
            self.metrics.fallbacks_active.labels(name).set(1 if active else 0)
            final = changed.get(name) or settings.get(name)
            if final is not None:
                self.metrics.knob.labels(name, knob_name(final.method)).set(getattr(final, knob_name(final.method)))
        decisions += self.rollout.tick(policy, self.epoch, rollback_alerts)
        return decisions

    def _seed(self, rc: Any, revision: int, now: float) -> EffectiveSettings:
        self.fallback.active.pop(rc.name, None)
        self.fallback.rules.forget(rc.name)
        self.bandits.pop(rc.name, None)
        return EffectiveSettings(request_class=rc.name, method=rc.method, gamma=rc.gamma.initial,
                                 medusa_heads=rc.medusa_heads.initial, tree_size=rc.tree_size.initial,
                                 fallback_active=False, probe_fraction=rc.adaptation.probe_fraction,
                                 revision=revision, updated_at=now)

    def _class_tick(self, policy: Any, rc: Any, current: EffectiveSettings, reading: Reading, now: float,
                    rollback_alerts: list[RuleOutcome]) -> tuple[Decision, EffectiveSettings | None]:
        name = rc.name
        stats = reading.stats
        inputs = window_inputs(stats)
        if current.fallback_active and not self.fallback.is_active(name):
            # fallen back before a controller restart (or by a webhook on another leader): resume that state
            self.fallback.force(name, "restored", "fallback_active in effective settings", current.updated_at)
        rules = [a for a in policy.alerts if a.applies_to(name)]
        outcomes = [self.fallback.rules.evaluate(rule, name, stats, now) for rule in rules]
        by_action = {r.name: r.action for r in rules}
        fallback_rules = [r for r in rules if r.action == "fallback"]
        fallback_outcomes = [o for o in outcomes if by_action[o.rule] == "fallback"]
        for o in outcomes:
            if by_action[o.rule] != "rollback":
                continue
            key = (name, o.rule)
            if o.firing and key not in self._rollback_fired:  # act once per firing episode
                self._rollback_fired.add(key)
                rollback_alerts.append(o)
            elif o.outcome == "ok":
                self._rollback_fired.discard(key)
        inputs["rules"] = [o.as_dict() for o in outcomes if o.outcome != "ok" or o.pending_s]
        if rc.method == "off":
            return Decision(name, "hold", "policy method is off", inputs=inputs), None
        verdict = self.fallback.step(name, fallback_rules, stats, now, fallback_outcomes)
        if verdict.action == "enter":
            # probes run at the smallest knob value: the cheapest speculation, the first to pay again
            knob = knob_name(rc.method)
            new = replace(current, fallback_active=True, probe_fraction=rc.adaptation.probe_fraction, updated_at=now,
                          **{knob: getattr(rc, knob).min})
            return Decision(name, "fallback_on", verdict.reason, _knobs(current), _knobs(new), inputs), new
        if verdict.action == "exit":
            new = replace(current, fallback_active=False, updated_at=now)
            self.bandits.pop(name, None)
            return Decision(name, "fallback_off", verdict.reason, _knobs(current), _knobs(new), inputs), new
        if verdict.action == "stay_off":
            return Decision(name, "hold", f"fallen back: {verdict.reason}", inputs=inputs), None
        if stats is None:
            self.metrics.inconclusive.labels(name).inc()
            why = reading.error or "no traffic in the window"
            return Decision(name, "inconclusive", why, inputs=inputs), None
        return self._adapt(rc, current, stats, now, inputs)

    def _adapt(self, rc: Any, current: EffectiveSettings, stats: Any, now: float,
               inputs: dict[str, Any]) -> tuple[Decision, EffectiveSettings | None]:
        mode = rc.adaptation.mode
        if mode == "fixed":
            return Decision(rc.name, "hold", "adaptation mode fixed", inputs=inputs), None
        knob = knob_name(rc.method)
        bounds = getattr(rc, knob)
        value = bounds.clamp(getattr(current, knob))
        guard = Guard(dead_band=rc.adaptation.dead_band, cooldown_s=rc.adaptation.cooldown_s,
                      max_step=rc.adaptation.max_step, settle_s=self.window_s)
        last_change = current.updated_at
        settled = now - last_change >= self.window_s
        if mode == "goodput":
            proposal = propose_goodput(stats, value, bounds.min, bounds.max)
            if proposal is None:
                return Decision(rc.name, "inconclusive", "window has no drafts to model", inputs=inputs), None
        else:
            bandit = self.bandits.setdefault(rc.name, BanditState())
            if settled and stats.speedup and stats.speedup > 0:
                bandit.update(value, float(stats.speedup))
            proposal = propose_bandit(bandit, value, bounds.min, bounds.max)
        inputs["estimates"] = {str(k): round(v, 3) for k, v in proposal.estimates.items()}
        step = guarded_step(value, proposal, now=now, last_change_at=last_change, guard=guard)
        if not step.changed:
            return Decision(rc.name, "hold", step.reason, inputs=inputs), None
        new = replace(current, **{knob: step.value}, updated_at=now)
        return Decision(rc.name, "adapt", step.reason, _knobs(current), _knobs(new), inputs), new

    # ------------------------------------------------------------------ webhooks
    def apply_alert(self, action: Any) -> list[Decision]:
        """Apply an alert delivered by webhook (``specops.alerts.webhook.AlertAction``)."""
        with self._lock:
            if not self._lead():
                log.warning("alert %s ignored: not the leader", getattr(action, "rule", "?"))
                return []
            policy = self.policy_provider()
            if policy is None:
                return []
            now = self.clock()
            kind = action.kind
            inputs = {"rule": action.rule, "fingerprint": action.fingerprint, "source": "webhook"}
            if kind == "rollback":
                return self.rollout.rollback_now(policy, self.epoch, f"alert {action.rule} (webhook)")
            if kind == "notify":
                self.store.append_audit({"kind": "alert.notify", "class": action.request_class, **inputs},
                                        epoch=self.epoch)
                return [Decision(action.request_class, "alert", f"notify: {action.rule}", inputs=inputs)]
            if kind != "fallback":
                raise ValueError(f"unknown alert action kind {kind!r}")
            names = [action.request_class] if action.request_class else policy.class_names
            unknown = [n for n in names if n not in policy.class_names]
            if unknown:
                raise ValueError(f"alert names unknown class {unknown[0]!r}")
            settings = self.store.effective()
            changed, decisions = {}, []
            for name in names:
                current = settings.get(name)
                if current is None or policy.get_class(name).method == "off":
                    continue
                if not self.fallback.force(name, action.rule, "webhook alert", now) and current.fallback_active:
                    continue
                new = replace(current, fallback_active=True, updated_at=now)
                changed[name] = new
                decisions.append(Decision(name, "fallback_on", f"alert {action.rule} (webhook)", _knobs(current),
                                          _knobs(new), inputs))
            if changed:
                self.store.set_effective(changed, epoch=self.epoch, reason=f"webhook alert {action.rule}",
                                         inputs={n: inputs for n in changed})
                for n in changed:
                    self.metrics.fallbacks_active.labels(n).set(1)
            for d in decisions:
                self.metrics.decisions.labels(d.request_class or "-", d.kind).inc()
            return decisions


def _knobs(s: EffectiveSettings | None) -> dict[str, Any]:
    if s is None:
        return {}
    return {"method": s.method, "gamma": s.gamma, "medusa_heads": s.medusa_heads, "tree_size": s.tree_size,
            "fallback_active": s.fallback_active}


def _summary(decisions: list[Decision]) -> str:
    parts = [f"{d.request_class}:{d.kind}" for d in decisions if d.changed and d.request_class]
    return ", ".join(parts) or "no change"
