"""The controller's own Prometheus metrics (served on its ``/metrics``).

Registered on an injected ``CollectorRegistry`` so tests (and the simulator) use a
fresh one instead of the process-global default. Their derived series (`PROMQL`,
`promql`) are part of the telemetry contract: `specops.telemetry.controller_series`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


TICK_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ControllerMetrics:
    """Decisions, rollbacks, fallbacks active, tick duration, analysis results."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "specops_controller_decisions_total", "Decisions taken by the controller, by class and kind.",
            ["class", "kind"], registry=r)
        self.rollbacks = Counter(
            "specops_controller_rollbacks_total", "Automatic policy rollbacks, by reason.", ["reason"], registry=r)
        self.fallbacks_active = Gauge(
            "specops_controller_fallbacks_active", "1 while the class is fallen back to plain decoding.",
            ["class"], registry=r)
        self.tick_seconds = Histogram(
            "specops_controller_tick_seconds", "Seconds one controller tick took.", buckets=TICK_BUCKETS_S, registry=r)
        self.analysis_runs = Counter(
            "specops_controller_analysis_runs_total", "Rollout analysis runs, by result.", ["result"], registry=r)
        self.inconclusive = Counter(
            "specops_controller_inconclusive_windows_total", "Class windows skipped as inconclusive (no or too little data).",
            ["class"], registry=r)
        self.knob = Gauge(
            "specops_controller_knob", "Knob value the controller set, by class and knob (gamma, medusa_heads).",
            ["class", "knob"], registry=r)
        self.is_leader = Gauge("specops_controller_is_leader", "1 while this controller holds the leader lease.",
                               registry=r)
