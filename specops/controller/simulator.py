"""``specops simulate``: the REAL controller against a REAL Redis, in simulated time.

Each tick (``interval_s`` simulated seconds):

1. every pod serves its traffic mix with the settings in force — the stable
   effective settings from the store, or, for the first ``weight``% of pods during a
   rollout, the canary revision's settings; a fallen-back class runs plain decoding
   except for its ``probe_fraction``;
2. each pod publishes one :class:`DecodeRecord` per class (sampled acceptance per
   draft position, costs from :mod:`sim_model`) through ``RedisPublisher`` — canary
   pods under the canary telemetry namespace;
3. the fake clock moves to the end of the tick and ``Controller.tick()`` runs (its
   wall time is what ``tick_ms_median`` reports).

Throughput is accounted with the *expected* speed of the settings in force (the same
function for the adaptive run, the fixed settings and the oracle), so comparisons
are not blurred by sampling noise; the controller itself only sees the sampled
records. A pod's traffic is a fixed token mix, so its speed is the harmonic mean
``1 / Σ share_c / speed_c`` (slow classes occupy the pod longer).
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from specops.controller.controller import Controller
from specops.controller.rollout_driver import canary_namespace
from specops.controller.sim_model import Scenario, binomial
from specops.controller.sources import RedisWindowSource
from specops.policies import parse_policy
from specops.policies import rollout as machine
from specops.policies.store import PolicyStore
from specops.telemetry.records import DecodeRecord
from specops.telemetry.redis_metrics import RedisPublisher, RedisWindowReader

log = logging.getLogger(__name__)

FOR_S = 20.0


def sim_policy_text(scenario: Scenario, *, bad: bool = False) -> str:
    """The policy the simulated fleet runs (``bad``: the canary with γ pinned at the maximum)."""
    g = scenario.gamma_max
    lines = [f"version: sim-{'bad' if bad else 'good'}", "description: fleet simulator policy",
             f"default_class: {scenario.classes[0].name}", "classes:"]
    for c in scenario.classes:
        gamma = f"{{initial: {g}, min: {g}, max: {g}}}" if bad else f"{{initial: 4, min: 1, max: {g}}}"
        mode = "fixed" if bad else "goodput"
        lines += [f"  - name: {c.name}", "    method: draft", f"    gamma: {gamma}",
                  f"    adaptation: {{mode: {mode}, dead_band: 0.03, cooldown_s: 10, max_step: 3, probe_fraction: 0.1}}"]
    lines += ["alerts:",
              "  - {name: spec-slower, metric: speedup, op: '<', threshold: 1.0, for_s: %g," % FOR_S,
              "     min_samples: 50, action: fallback, severity: critical}",
              "rollout:",
              "  steps: [{weight: 25, pause_s: 60}, {weight: 50, pause_s: 60}, {weight: 100}]",
              "  analysis: {interval_s: 10, window_s: 10, failure_limit: 0, inconclusive_limit: 3,",
              "             consecutive_error_limit: 2, rules: [spec-slower]}"]
    return "\n".join(lines) + "\n"


class _Deferred:
    """A pipeline view whose ``execute`` is deferred to the batch flush."""

    def __init__(self, pipe) -> None:
        self._pipe = pipe

    def __getattr__(self, name: str):
        return getattr(self._pipe, name)

    def execute(self) -> list:
        return []


class _BatchingRedis:
    """Collects every publisher's commands of one tick into one pipeline (simulation speed only)."""

    def __init__(self, client) -> None:
        self.client = client
        self.pipe = client.pipeline(transaction=False)

    def pipeline(self, transaction: bool = True) -> _Deferred:
        return _Deferred(self.pipe)

    def flush(self) -> None:
        self.pipe.execute()


@dataclass
class _Setting:
    gamma: int  # 0 = plain
    probe: float = 0.0  # share of traffic still speculating (fallback)
    probe_gamma: int = 0


@dataclass
class SimResult:
    figures: dict[str, Any]
    timeline: list[dict[str, Any]] = field(default_factory=list)


class FleetSimulator:
    """Runs a :class:`Scenario` against the real controller and store."""

    def __init__(self, scenario: Scenario, redis_client, *, namespace: str = "sim", progress=None) -> None:
        self.s = scenario
        self.redis = redis_client
        self.ns = namespace
        self.now = 1_700_000_000.0  # aligned to the 10 s buckets
        self.rng = random.Random(scenario.seed)
        self.progress = progress
        clock = lambda: self.now  # noqa: E731 - the simulator's fake clock
        self.clock = clock
        self.store = PolicyStore(redis_client, namespace=namespace, clock=clock)
        self.batch = _BatchingRedis(redis_client)
        bucket = scenario.interval_s
        self.publishers = [RedisPublisher(self.batch, f"pod-{p:04d}", bucket_s=bucket, clock=clock, namespace=namespace)
                           for p in range(scenario.pods)]
        self.canary_publishers = [RedisPublisher(self.batch, f"pod-{p:04d}", bucket_s=bucket, clock=clock,
                                                 namespace=canary_namespace(namespace)) for p in range(scenario.pods)]
        source = RedisWindowSource(RedisWindowReader(redis_client, bucket_s=bucket, clock=clock, namespace=namespace))
        canary = RedisWindowSource(RedisWindowReader(redis_client, bucket_s=bucket, clock=clock,
                                                     namespace=canary_namespace(namespace)))
        self.controller = Controller(self.store, source, clock=clock, registry=CollectorRegistry(),
                                     window_s=scenario.interval_s, canary_source=canary)

    # ---------------------------------------------------------------- settings in force
    def _stable(self) -> dict[str, _Setting]:
        out = {}
        for name, e in self.store.effective().items():
            if e.method == "off":
                out[name] = _Setting(0)
            elif e.fallback_active:
                out[name] = _Setting(0, e.probe_fraction, e.gamma)
            else:
                out[name] = _Setting(e.gamma)
        return out

    def _canary(self) -> tuple[dict[str, _Setting], int]:
        state = self.store.rollout_state()
        if state is None or not state.active or state.weight <= 0:
            return {}, 0
        policy = self.store.get_revision(state.revision).policy
        eff = machine.effective_for(policy, state.revision, self.now)
        return {n: _Setting(e.gamma if e.method != "off" else 0) for n, e in eff.items()}, state.weight

    # ---------------------------------------------------------------- one pod's traffic
    def _speed(self, alpha: float, factor: float, st: _Setting) -> float:
        c = self.s.costs
        if st.probe > 0:
            return 1.0 / ((1 - st.probe) / c.speed(alpha, 0) + st.probe / c.speed(alpha, st.probe_gamma, factor))
        return c.speed(alpha, st.gamma, factor)

    def _pod_speed(self, cond: dict, settings: dict[str, _Setting]) -> float:
        return 1.0 / sum(share / self._speed(a, f, settings[n]) for n, (a, share, f) in cond.items())

    def _record(self, name: str, seconds: float, alpha: float, factor: float, gamma: int) -> DecodeRecord | None:
        c = self.s.costs
        if seconds <= 0:
            return None
        if gamma <= 0:
            n = max(1, int(seconds / c.plain_s))
            wall = n * c.plain_s
            return DecodeRecord(name, "ar", n, 0, 0, [], n, 0.0, wall, wall, wall, [], [], [], 0, 0)
        rounds = max(1, int(seconds / c.round_s(gamma, factor)))
        per_pos, alive = [], rounds
        for _ in range(gamma):
            alive = binomial(self.rng, alive, alpha)
            per_pos.append(alive)
        accepted = sum(per_pos)
        new_tokens = accepted + rounds
        noise = 1.0 + self.rng.gauss(0.0, 0.01)
        draft_s = rounds * gamma * c.draft_s * factor * noise
        verify_s = rounds * (c.plain_s + c.verify_slope_s * gamma) * noise
        return DecodeRecord(name, "draft", new_tokens, rounds * gamma, accepted, per_pos, rounds, draft_s, verify_s,
                            draft_s + verify_s, new_tokens * c.plain_s, [], [], [], gamma, 0)

    def _publish_pod(self, pub: RedisPublisher, cond: dict, settings: dict[str, _Setting]) -> None:
        speed = self._pod_speed(cond, settings)
        for name, (alpha, share, factor) in cond.items():
            st = settings[name]
            seconds = self.s.interval_s * speed * share / self._speed(alpha, factor, st)
            parts = [(seconds * (1 - st.probe), 0), (seconds * st.probe, st.probe_gamma)] if st.probe else [(seconds, st.gamma)]
            for secs, gamma in parts:
                rec = self._record(name, secs, alpha, factor, gamma)
                if rec is not None:
                    pub.publish(rec)

    # ---------------------------------------------------------------- the run
    def run(self) -> SimResult:
        s = self.s
        good_text, bad_text = sim_policy_text(s), sim_policy_text(s, bad=True)
        machine.start_rollout(self.store, parse_policy(good_text, "<sim>"), good_text, actor="simulator")
        stable_rev = self.store.current_revision()
        fixed_options = [0, *range(1, s.gamma_max + 1)]
        totals = {"adaptive": 0.0, "oracle": 0.0, **{f"fixed_{g}": 0.0 for g in fixed_options}}
        tick_ms, timeline = [], []
        fallback_ticks: dict[str, list[int]] = {}
        rollback_tick = None
        for k in range(s.ticks):
            self.now = 1_700_000_000.0 + k * s.interval_s + 1.0
            if s.canary_tick is not None and k == s.canary_tick:
                machine.start_rollout(self.store, parse_policy(bad_text, "<sim-bad>"), bad_text, actor="simulator")
            cond = s.conditions(k)
            stable = self._stable()
            canary, weight = self._canary()
            n_canary = round(s.pods * weight / 100) if canary else 0
            for p in range(s.pods):
                if p < n_canary:
                    self._publish_pod(self.canary_publishers[p], cond, canary)
                else:
                    self._publish_pod(self.publishers[p], cond, stable)
            self.batch.flush()
            adaptive = (s.pods - n_canary) * self._pod_speed(cond, stable)
            if n_canary:
                adaptive += n_canary * self._pod_speed(cond, canary)
            oracle = s.pods * self._pod_speed(cond, {n: _Setting(s.best_setting(a, f)) for n, (a, _, f) in cond.items()})
            totals["adaptive"] += adaptive
            totals["oracle"] += oracle
            for g in fixed_options:
                totals[f"fixed_{g}"] += s.pods * self._pod_speed(cond, {n: _Setting(g) for n in cond})
            self.now = 1_700_000_000.0 + (k + 1) * s.interval_s - 0.001  # end of the tick's bucket
            started = time.perf_counter()
            decisions = self.controller.tick()
            tick_ms.append((time.perf_counter() - started) * 1e3)
            for d in decisions:
                if d.kind == "fallback_on":
                    fallback_ticks.setdefault(d.request_class, []).append(k)
                if d.kind == "rollout.rollback" and rollback_tick is None:
                    rollback_tick = k
            timeline.append({"tick": k, "adaptive": adaptive, "oracle": oracle,
                             "gamma": {n: st.gamma if not st.probe else 0 for n, st in stable.items()},
                             "canary_weight": weight if canary else 0})
            if self.progress is not None:
                self.progress(k + 1)
        return SimResult(self._figures(totals, tick_ms, fallback_ticks, rollback_tick, stable_rev), timeline)

    def _figures(self, totals: dict[str, float], tick_ms: list[float], fallback_ticks: dict[str, list[int]],
                 rollback_tick: int | None, stable_rev: int | None) -> dict[str, Any]:
        s = self.s
        seconds = s.ticks * s.interval_s
        tps = {k: v * s.interval_s / seconds for k, v in totals.items()}
        fixed = {k: v for k, v in tps.items() if k.startswith("fixed_")}
        best_fixed = max(fixed, key=fixed.get)
        for_ticks = int(-(-FOR_S // s.interval_s))
        detect = {}
        for inc in s.incidents:
            hits = [t for t in fallback_ticks.get(inc.request_class, []) if t >= inc.start_tick]
            detect[f"{inc.kind}:{inc.request_class}"] = hits[0] - inc.start_tick - for_ticks if hits else None
        known = [v for v in detect.values() if v is not None]
        state = self.store.rollout_state()
        rolled_back = (s.canary_tick is not None and state is not None and state.phase == "degraded"
                       and self.store.current_revision() == stable_rev)
        return {
            "pods": s.pods, "classes": len(s.classes), "ticks": s.ticks, "seed": s.seed, "interval_s": s.interval_s,
            "tokens_per_s": {k: round(v, 2) for k, v in tps.items()},
            "best_fixed": best_fixed,
            "adaptive_vs_oracle": round(tps["adaptive"] / tps["oracle"], 4),
            "adaptive_vs_best_fixed": round(tps["adaptive"] / fixed[best_fixed], 4),
            "fallback_detect_ticks": max(known) if len(known) == len(detect) else None,
            "fallback_detect_ticks_by_incident": detect,
            "bad_canary_rolled_back": bool(rolled_back),
            "canary_rollback_after_ticks": (rollback_tick - s.canary_tick) if rollback_tick is not None
            and s.canary_tick is not None else None,
            "tick_ms_median": round(statistics.median(tick_ms), 3) if tick_ms else None,
            "tick_ms_max": round(max(tick_ms), 3) if tick_ms else None,
            "audit_events": len(self.store.read_audit(count=100_000)),
        }
