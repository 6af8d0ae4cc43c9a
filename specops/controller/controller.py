"""The control loop: one ``tick()`` reads every class's metric window and acts.

Per class and tick:

1. read the class's window from the metric source (one round trip for all classes);
   no data → inconclusive: nothing changes, and nothing counts as pass or failure;
2. evaluate the policy's alert rules with their ``for`` durations; a firing
   ``fallback`` rule turns speculation off for the class (``fallback_active``, with
   ``probe_fraction`` of traffic still speculating); probes that pay again turn it
   back on; a firing ``rollback`` rule rolls an active canary back;
3. otherwise adapt the knob (γ for draft/ngram, heads for medusa) by the class's
   ``adaptation.mode``, guarded by dead-band, cooldown and max step.

All changes of a tick are written in ONE fenced store commit (with the inputs that
led to them, which the store appends to the audit stream), conditional on the
settings the tick read (an operator's change in between wins; the tick is redone
next time); rollout analysis runs through
:class:`~specops.controller.rollout_driver.RolloutDriver`. The controller acts only
while it holds the leader lease (when one is given), and every write carries the
lease's fence (epoch and token).

Redis is the truth, memory only a cache: which classes are fallen back is rebuilt
from the effective settings every tick, the bandit statistics are read from and
written to the store, and the in-memory rule bookkeeping of a tick is rolled back
when its commit fails — so a safety action whose write did not land is decided
again at the next tick instead of being forgotten.

A ``rollback`` rule acts once per revision: the rollback is decided against the
revision the tick read (a compare-and-set in the store), only once the current
revision (or a stopped canary) has been in effect for a whole window — the window
before that still measures the revision that was rolled back — and never returns
to a revision that was itself rolled back from.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import redis

from specops.alerts.webhook import AlertDeferred, AlertRejected
from specops.controller.adapt import (
    BanditState,
    Guard,
    guarded_step,
    nearest_arm,
    propose_bandit,
    propose_goodput,
    tree_size_arms,
)
from specops.controller.fallback import FallbackManager, RuleOutcome
from specops.controller.metrics import ControllerMetrics
from specops.controller.decision import Decision
from specops.controller.rollout_driver import RolloutDriver
from specops.controller.sources import MetricSource, Reading, read_many
from specops.policies.errors import ConflictError, StaleEpochError, StoreUnavailableError
from specops.policies.state import EffectiveSettings

log = logging.getLogger(__name__)

#: Default timing slack of the adaptation guard, as a share of the metrics window: the
#: cooldown and the settle time count as elapsed up to this much early (tick jitter).
TIMING_SLACK = 0.01


def knob_name(method: str) -> str:
    """The knob adapted for a method: ``medusa_heads`` for medusa, ``gamma`` otherwise."""
    return "medusa_heads" if method == "medusa" else "gamma"


def adapts_tree(rc: Any) -> bool:
    """Whether the class's tree size is adapted beside its knob: a Medusa class's, and an eagle
    class's that drafts EAGLE-2 trees (``eagle_topk``)."""
    return rc.method == "medusa" or (rc.method == "eagle" and getattr(rc, "eagle_topk", None) is not None)


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
    out["drafted_per_pos"] = list(getattr(stats, "drafted_per_pos", []))[:16]
    return out


class Controller:
    """The adaptive controller; see the module docstring."""

    def __init__(self, store, sources: MetricSource, policy_provider: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.time, registry=None, lease=None, *,
                 window_s: float = 30.0, canary_source: MetricSource | None = None,
                 exit_margin: float = 0.02, keeper=None, timing_slack_s: float | None = None) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        if timing_slack_s is not None and not 0 <= timing_slack_s < window_s:
            raise ValueError(f"timing_slack_s must lie in [0, window_s), got {timing_slack_s}")
        if keeper is not None and (lease is None or keeper.lease is not lease):
            raise ValueError("the lease keeper must keep the controller's lease")
        self.store = store
        self.source = sources
        self.policy_provider = policy_provider or store.current_policy
        self.clock = clock
        self.metrics = ControllerMetrics(registry)
        self.lease = lease
        self.keeper = keeper
        self.window_s = window_s
        # tick jitter tolerated by the cooldown / settle comparisons (see specops.controller.adapt)
        self.timing_slack_s = window_s * TIMING_SLACK if timing_slack_s is None else timing_slack_s
        self.fallback = FallbackManager(exit_margin=exit_margin)
        self.bandits: dict[str, dict[str, BanditState]] = {}  # class -> knob -> arms (a cache of the store's)
        self.rollout = RolloutDriver(store, canary_source, clock, self.metrics)
        self._lock = threading.Lock()
        self._rollback_done: set[tuple[str, str, int]] = set()  # (class, rule, revision) acted on or skipped
        self.last_tick_s: float = 0.0

    # ------------------------------------------------------------------ leadership
    @property
    def epoch(self):
        """The fence every write carries (None without a lease)."""
        return self.lease.fence if self.lease is not None else None

    def _lead(self) -> bool:
        if self.lease is None:
            return True
        if self.keeper is not None:  # the keeper renews on its own thread; only acquire here if we lost it
            ok = self.lease.is_leader or self.keeper.keep()
        else:
            ok = self.lease.renew() if self.lease.is_leader else self.lease.try_acquire()
        self.metrics.is_leader.set(1 if ok else 0)
        return bool(ok)

    # ------------------------------------------------------------------ tick
    def tick(self) -> list[Decision]:
        """One pass over all classes; returns every decision (holds included)."""
        started = time.perf_counter()
        with self._lock:
            saved = (copy.deepcopy(self.fallback), copy.deepcopy(self.bandits), set(self._rollback_done))
            try:
                if not self._lead():
                    log.debug("not the leader: tick skipped")
                    return []
                decisions = self._tick()
            except ConflictError as exc:
                self.fallback, self.bandits, self._rollback_done = saved
                log.info("state changed concurrently, tick abandoned (next tick retries): %s", exc)
                return []
            except StaleEpochError as exc:
                self.fallback, self.bandits, self._rollback_done = saved
                log.warning("lost leadership mid-tick, nothing written: %s", exc)
                self.metrics.is_leader.set(0)
                return []
            except BaseException:
                # e.g. Redis down: nothing of this tick was written, so nothing of it is remembered either
                self.fallback, self.bandits, self._rollback_done = saved
                raise
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
        state = self.store.rollout_state()
        self.bandits = self._load_bandits()
        names = policy.class_names
        readings = read_many(self.source, names, self.window_s)
        decisions: list[Decision] = []
        changed: dict[str, EffectiveSettings] = {}
        bandits_before = {n: {k: b.to_dict() for k, b in arms.items()} for n, arms in self.bandits.items()}
        rollback_alerts: list[RuleOutcome] = []
        settled = self._settled_for_rollback(state, now)
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
                                             rollback_alerts, revision, settled)
            decisions.append(decision)
            if new is not None:
                changed[name] = new
        bandits = {n: {k: b.to_dict() for k, b in arms.items()} for n, arms in self.bandits.items()}
        bandits_changed = {n: v for n, v in bandits.items() if bandits_before.get(n) != v}
        bandits_changed.update({n: {} for n in bandits_before if n not in bandits})
        expect = {n: settings.get(n) for n in changed}
        if changed:
            self.store.set_effective(changed, epoch=self.epoch, reason=_summary(decisions), expect=expect,
                                     bandits=bandits_changed or None,
                                     inputs={d.request_class: {"kind": d.kind, "reason": d.reason,
                                                               "before": d.before, **d.inputs}
                                             for d in decisions if d.changed and d.request_class})
        elif bandits_changed:
            self.store.commit(epoch=self.epoch, actor="controller", bandits=bandits_changed)
        for name in names:
            active = self.fallback.is_active(name)
            self.metrics.fallbacks_active.labels(name).set(1 if active else 0)
            final = changed.get(name) or settings.get(name)
            if final is not None:
                self.metrics.knob.labels(name, knob_name(final.method)).set(getattr(final, knob_name(final.method)))
                if final.method == "medusa":
                    self.metrics.knob.labels(name, "tree_size").set(final.tree_size)
        decisions += self._rollbacks(policy, rollback_alerts, revision, state)
        decisions += self.rollout.tick(policy, self.epoch, [], state=None)
        return decisions

    # ------------------------------------------------------------------ rollback rules
    def _settled_for_rollback(self, state: Any, now: float) -> bool:
        """Whether the window now measures only the current revision (see the module docstring)."""
        changes = [self.store.current_since() or 0.0]
        if state is not None and state.phase in ("degraded", "aborted"):
            changes.append(state.updated_at)
        return now - max(changes) >= self.window_s

    def _rollbacks(self, policy: Any, alerts: list[RuleOutcome], revision: int, state: Any) -> list[Decision]:
        todo = [o for o in alerts if (o.request_class, o.rule, revision) not in self._rollback_done]
        if not todo:
            return []
        rules = sorted({o.rule for o in todo})
        out = self.rollout.rollback_now(policy, self.epoch, f"alert {', '.join(rules)} firing", state=state,
                                        against=revision)
        for o in todo:  # acted on (or found done / impossible): remembered only now, after the write
            self._rollback_done.add((o.request_class, o.rule, revision))
        return out

    def _seed(self, rc: Any, revision: int, now: float) -> EffectiveSettings:
        self.fallback.active.pop(rc.name, None)
        self.fallback.rules.forget(rc.name)
        self.bandits.pop(rc.name, None)
        return EffectiveSettings(request_class=rc.name, method=rc.method, gamma=rc.gamma.initial,
                                 medusa_heads=rc.medusa_heads.initial, tree_size=rc.tree_size.initial,
                                 fallback_active=False, probe_fraction=rc.adaptation.probe_fraction,
                                 revision=revision, updated_at=now)

    def _load_bandits(self) -> dict[str, dict[str, BanditState]]:
        out: dict[str, dict[str, BanditState]] = {}
        for name, knobs in self.store.bandit_stats().items():
            try:
                arms = {knob: BanditState.from_dict(data) for knob, data in dict(knobs).items()}
            except (ValueError, TypeError) as exc:
                log.warning("class %s: stored bandit statistics unreadable (%s); starting afresh", name, exc)
                continue
            if arms:
                out[name] = arms
        return out

    def _class_tick(self, policy: Any, rc: Any, current: EffectiveSettings, reading: Reading, now: float,
                    rollback_alerts: list[RuleOutcome], revision: int = 0,
                    settled: bool = True) -> tuple[Decision, EffectiveSettings | None]:
        name = rc.name
        stats = reading.stats
        inputs = window_inputs(stats)
        # the store is the truth about fallbacks: resume one set before a restart (or by a webhook on another
        # leader), forget one whose write never landed or that an operator cleared
        if current.fallback_active and not self.fallback.is_active(name):
            self.fallback.force(name, "restored", "fallback_active in effective settings", current.updated_at)
        elif not current.fallback_active and self.fallback.is_active(name):
            self.fallback.active.pop(name, None)
        rules = [a for a in policy.alerts if a.applies_to(name)]
        outcomes = [self.fallback.rules.evaluate(rule, name, stats, now) for rule in rules]
        by_action = {r.name: r.action for r in rules}
        fallback_rules = [r for r in rules if r.action == "fallback"]
        fallback_outcomes = [o for o in outcomes if by_action[o.rule] == "fallback"]
        for o in outcomes:
            if by_action[o.rule] != "rollback":
                continue
            if o.firing and settled:
                rollback_alerts.append(o)
            elif o.outcome == "ok":
                self._rollback_done = {k for k in self._rollback_done if k[:2] != (name, o.rule)}
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
            knob = knob_name(rc.method)
            resume, why = self._resume_value(rc, current, stats, now)
            new = replace(current, fallback_active=False, updated_at=now, **{knob: resume})
            self.bandits.pop(name, None)
            reason = verdict.reason + (f"; {why}" if why else "")
            return Decision(name, "fallback_off", reason, _knobs(current), _knobs(new), inputs), new
        if verdict.action == "stay_off":
            return Decision(name, "hold", f"fallen back: {verdict.reason}", inputs=inputs), None
        if stats is None:
            self.metrics.inconclusive.labels(name).inc()
            why = reading.error or "no traffic in the window"
            return Decision(name, "inconclusive", why, inputs=inputs), None
        return self._adapt(rc, current, stats, now, inputs)

    def _resume_value(self, rc: Any, current: EffectiveSettings, stats: Any, now: float) -> tuple[int, str]:
        """The knob value to leave a fallback with. The probes ran at the knob's minimum
        (cheapest while speculation did not pay); in ``goodput`` mode the window that showed
        them paying also fits the round model (plain requests taken out), so speculation
        resumes at its guarded choice (dead-band, ``max_step``) instead of climbing from the
        minimum one settled window at a time. Other modes keep the probe value."""
        knob = knob_name(rc.method)
        bounds = getattr(rc, knob)
        value = bounds.clamp(getattr(current, knob))
        if rc.adaptation.mode != "goodput" or stats is None:
            return value, ""
        proposal = propose_goodput(stats, value, bounds.min, bounds.max, with_plain=True)
        if proposal is None:
            return value, ""
        guard = Guard(dead_band=rc.adaptation.dead_band, cooldown_s=0.0, max_step=rc.adaptation.max_step)
        step = guarded_step(value, proposal, now=now, last_change_at=None, guard=guard)
        return step.value, (f"resume at {knob} {step.value} ({step.reason})" if step.changed else "")

    def _adapt(self, rc: Any, current: EffectiveSettings, stats: Any, now: float,
               inputs: dict[str, Any]) -> tuple[Decision, EffectiveSettings | None]:
        mode = rc.adaptation.mode
        if mode == "fixed":
            return Decision(rc.name, "hold", "adaptation mode fixed", inputs=inputs), None
        knob = knob_name(rc.method)
        bounds = getattr(rc, knob)
        value = bounds.clamp(getattr(current, knob))
        guard = Guard(dead_band=rc.adaptation.dead_band, cooldown_s=rc.adaptation.cooldown_s,
                      max_step=rc.adaptation.max_step, settle_s=self.window_s, slack_s=self.timing_slack_s)
        last_change = current.updated_at
        settled = now - last_change + self.timing_slack_s >= self.window_s
        arms = self.bandits.setdefault(rc.name, {}) if mode == "bandit" or adapts_tree(rc) else {}
        # Every request of the window ran under a planner (specops serve's engine), for which
        # the knob is a cap it plans each round under, shortening or skipping rounds when its
        # measured costs say so: a lower cap can only take choices from it. Such a knob is
        # only ever raised here (acceptance that pays deeper at the window's load); lowering
        # it for cost would fit a load that is gone by the next window (measured: caps cut
        # at concurrency 16 then slowed concurrency 1). Fallback still turns it off.
        planned = 0 < stats.requests <= getattr(stats, "planned", 0)
        lo = value if planned else bounds.min
        if planned:
            inputs["planned"] = True
        if mode == "goodput":
            proposal = propose_goodput(stats, value, lo, bounds.max)
            if proposal is None:
                return Decision(rc.name, "inconclusive", "window has no drafts to model", inputs=inputs), None
        else:
            bandit = arms.setdefault(knob, BanditState())
            if settled and stats.speedup and stats.speedup > 0:
                bandit.update(value, float(stats.speedup))
            proposal = propose_bandit(bandit, value, lo, bounds.max)
        inputs["estimates"] = {str(k): round(v, 3) for k, v in proposal.estimates.items()}
        inputs["estimate_unit"] = "tokens/s" if mode == "goodput" else "speed-up"
        inputs["expected_gain"] = round(proposal.expected_gain, 4) if proposal.expected_gain != float("inf") else None
        inputs["dead_band"] = rc.adaptation.dead_band
        step = guarded_step(value, proposal, now=now, last_change_at=last_change, guard=guard)
        tree = (self._adapt_tree(rc, current, stats, now, arms, guard, settled, planned)
                if adapts_tree(rc) else None)
        if not step.changed:
            if tree is not None:  # heads (γ) hold: the tree size may move (one knob per window)
                new_size, why, estimates = tree
                inputs["tree_estimates"] = estimates
                new = replace(current, tree_size=new_size, updated_at=now)
                return Decision(rc.name, "adapt", why, _knobs(current), _knobs(new), inputs), new
            why = step.reason + ("; a planned runtime's cap is only raised" if planned else "")
            return Decision(rc.name, "hold", why, inputs=inputs), None
        new = replace(current, **{knob: step.value}, updated_at=now)
        return Decision(rc.name, "adapt", step.reason, _knobs(current), _knobs(new), inputs), new

    def _adapt_tree(self, rc: Any, current: EffectiveSettings, stats: Any, now: float,
                    arms: dict[str, BanditState], guard: Guard, settled: bool,
                    planned: bool = False) -> tuple[int, str, dict] | None:
        """The tree-size bound's bandit step (a Medusa or an EAGLE-2 tree: see ``specops.controller.adapt``);
        None when it holds.
        ``planned``: the runtime sizes trees under the bound each round, so it is only raised."""
        bounds = rc.tree_size
        grid = tree_size_arms(bounds.min, bounds.max)
        value = nearest_arm(grid, bounds.clamp(current.tree_size))
        if planned:
            grid = [a for a in grid if a >= value]
        bandit = arms.setdefault("tree_size", BanditState())
        if settled and stats.speedup and stats.speedup > 0:
            bandit.update(value, float(stats.speedup))
        proposal = propose_bandit(bandit, value, bounds.min, bounds.max, arms=grid)
        step = guarded_step(value, proposal, now=now, last_change_at=current.updated_at,
                            guard=replace(guard, max_step=max(1, bounds.max - bounds.min)))
        if not step.changed or step.value == current.tree_size:
            return None
        # one grid position per change, like max_step for the other knobs
        i, j = grid.index(value), grid.index(nearest_arm(grid, step.value))
        target = grid[i + max(-1, min(1, j - i))] if j != i else step.value
        estimates = {str(k): round(v, 3) for k, v in proposal.estimates.items()}
        return target, f"tree size: {proposal.reason}; {current.tree_size} -> {target}", estimates

    # ------------------------------------------------------------------ webhooks
    def apply_alert(self, action: Any) -> list[Decision]:
        """Apply an alert delivered by webhook (``specops.alerts.webhook.AlertAction``).

        Raises :class:`~specops.alerts.webhook.AlertDeferred` when this controller is
        not the leader or Redis is unavailable (the sender retries, and the leader
        acts), :class:`~specops.alerts.webhook.AlertRejected` when the alert cannot
        apply to the current policy (unknown class or rule).
        """
        with self._lock:
            try:
                return self._apply_alert(action)
            except StoreUnavailableError as exc:
                raise AlertDeferred(f"policy store unavailable: {exc}", retry_after_s=exc.retry_after_s) from exc
            except (redis.ConnectionError, redis.TimeoutError) as exc:  # the lease's own round trips
                raise AlertDeferred(f"Redis unavailable: {exc}", retry_after_s=1.0) from exc
            except ConflictError as exc:
                raise AlertDeferred(f"state changed concurrently: {exc}", retry_after_s=1.0) from exc
            except StaleEpochError as exc:
                self.metrics.is_leader.set(0)
                raise AlertDeferred(f"lost leadership: {exc}", retry_after_s=1.0) from exc

    def _apply_alert(self, action: Any) -> list[Decision]:
        if not self._lead():
            holder = self.lease.holder() if self.lease is not None else None
            log.info("alert %s deferred: not the leader (the lease is held by %s)", action.rule, holder)
            raise AlertDeferred(f"this controller is not the leader (leader: {holder or 'none'}); retry", 2.0)
        policy = self.policy_provider()
        if policy is None:
            raise AlertDeferred("no current policy revision yet; retry", 5.0)
        now = self.clock()
        kind = action.kind
        if kind is None:  # a hand-written rule (e.g. Grafana's UI) without an action label: the policy says
            rule = next((r for r in policy.alerts if r.name == action.rule), None)
            if rule is None:
                raise AlertRejected(f"alert names rule {action.rule!r}, which the current policy does not have, "
                                    "and carries no action label (fallback | rollback | notify)")
            kind = rule.action
        if action.request_class is not None and action.request_class not in policy.class_names:
            raise AlertRejected(f"alert names class {action.request_class!r}, which the current policy does not "
                                f"have (classes: {', '.join(policy.class_names)})")
        inputs = {"rule": action.rule, "fingerprint": action.fingerprint, "source": "webhook",
                  "starts_at": getattr(action, "starts_at", None), "revision": self.store.current_revision()}
        if kind == "rollback":
            return self._alert_rollback(policy, action, now)
        if kind == "notify":
            self.store.append_audit({"kind": "alert.notify", "class": action.request_class, **inputs},
                                    epoch=self.epoch)
            return [Decision(action.request_class, "alert", f"notify: {action.rule}", inputs=inputs)]
        if kind != "fallback":
            raise AlertRejected(f"unknown alert action {kind!r}")
        names = [action.request_class] if action.request_class else policy.class_names
        settings = self.store.effective()
        changed, decisions = {}, []
        for name in names:
            current = settings.get(name)
            if current is None or policy.get_class(name).method == "off" or current.fallback_active:
                continue
            new = replace(current, fallback_active=True, updated_at=now)
            changed[name] = new
            decisions.append(Decision(name, "fallback_on", f"alert {action.rule} (webhook)", _knobs(current),
                                      _knobs(new), inputs))
        if changed:
            self.store.set_effective(changed, epoch=self.epoch, reason=f"webhook alert {action.rule}",
                                     inputs={d.request_class: {"kind": d.kind, "reason": d.reason,
                                                               "before": d.before, **d.inputs} for d in decisions},
                                     expect={n: settings[n] for n in changed})
            for n in changed:  # only now that the write landed
                self.fallback.force(n, action.rule, "webhook alert", now)
                self.metrics.fallbacks_active.labels(n).set(1)
        for d in decisions:
            self.metrics.decisions.labels(d.request_class or "-", d.kind).inc()
        return decisions

    def _alert_rollback(self, policy: Any, action: Any, now: float) -> list[Decision]:
        """A rollback alert acts against the revision current when it started firing, once."""
        starts_at = getattr(action, "starts_at", None)
        revision = self.store.current_revision()
        since = self.store.current_since()
        reason = f"alert {action.rule} (webhook)"
        if revision is None:
            return []
        if starts_at is not None and since is not None and since > starts_at:
            why = (f"revision {revision} became current after the alert started firing: "
                   "this alert was already acted on (or concerns an earlier revision)")
            log.info("%s: rollback skipped: %s", reason, why)
            self.store.append_audit({"kind": "rollback.skipped", "reason": reason, "why": why,
                                     "fingerprint": action.fingerprint}, epoch=self.epoch)
            return [Decision(None, "rollout.rollback_skipped", f"{reason}: {why}")]
        decisions = self.rollout.rollback_now(policy, self.epoch, reason, against=revision, since=starts_at)
        for d in decisions:
            self.metrics.decisions.labels("-", d.kind).inc()
        return decisions


def _knobs(s: EffectiveSettings | None) -> dict[str, Any]:
    if s is None:
        return {}
    return {"method": s.method, "gamma": s.gamma, "medusa_heads": s.medusa_heads, "tree_size": s.tree_size,
            "fallback_active": s.fallback_active}


def _summary(decisions: list[Decision]) -> str:
    parts = [f"{d.request_class}:{d.kind}" for d in decisions if d.changed and d.request_class]
    return ", ".join(parts) or "no change"
