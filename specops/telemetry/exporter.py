"""Prometheus exporter: turns each `DecodeRecord` into the contract's metric families.

The third metric layer (record → window aggregator → exporter). The registry is
injected; tests pass a fresh ``CollectorRegistry()``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specops.telemetry import contract as c
from specops.telemetry.records import DecodeRecord


def _family_name(spec: c.MetricSpec) -> str:
    """prometheus_client appends ``_total`` to counters itself."""
    return spec.name[: -len("_total")] if spec.kind == "counter" else spec.name


class PrometheusExporter:
    """Registers the contract's metrics in ``registry`` and updates them per record."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}
        for spec in c.METRICS:
            name = _family_name(spec)
            if spec.kind == "counter":
                metric = Counter(name, spec.help, spec.labels, registry=self.registry)
            elif spec.kind == "gauge":
                metric = Gauge(name, spec.help, spec.labels, registry=self.registry)
            elif spec.kind == "histogram":
                metric = Histogram(name, spec.help, spec.labels, buckets=c.LATENCY_BUCKETS_S, registry=self.registry)
            else:  # pragma: no cover - the contract only holds the three kinds
                raise ValueError(f"unknown metric kind {spec.kind!r} for {spec.name}")
            self._metrics[spec.name] = metric

    def _inc(self, spec: c.MetricSpec, labels: tuple[str, ...], amount: float) -> None:
        # Touch the child even for 0 so every series exists from the first request on
        # (rate() over a series that appears late loses its first increase).
        self._metrics[spec.name].labels(*labels).inc(amount)

    def observe(self, record: DecodeRecord) -> None:
        """Account one finished request."""
        base = (record.request_class, record.method)
        self._inc(c.REQUESTS, base, 1)
        self._inc(c.GENERATED_TOKENS, base, record.new_tokens)
        self._inc(c.DRAFTED_TOKENS, base, record.drafted)
        self._inc(c.ACCEPTED_TOKENS, base, record.accepted)
        self._inc(c.TARGET_FORWARDS, base, record.target_forwards)
        if record.planned:
            self._inc(c.PLANNED_REQUESTS, base, 1)
        self._inc(c.DRAFT_SECONDS, base, record.draft_s)
        self._inc(c.VERIFY_SECONDS, base, record.verify_s)
        self._inc(c.DECODE_SECONDS, base, record.wall_s)
        self._inc(c.PLAIN_SECONDS_ESTIMATE, base, record.plain_s_estimate)
        for position, count in enumerate(record.accepted_per_pos):
            self._inc(c.ACCEPTED_BY_POSITION, base + (str(position),), count)
        for position, count in enumerate(record.drafted_per_pos):
            self._inc(c.DRAFTED_BY_POSITION, base + (str(position),), count)
        for head, (predicted, correct) in enumerate(zip(record.head_predictions, record.head_correct)):
            self._inc(c.HEAD_PREDICTIONS, base + (str(head),), predicted)
            self._inc(c.HEAD_CORRECT, base + (str(head),), correct)
        if record.fallback_reason:
            self._inc(c.FALLBACKS, base + (record.fallback_reason,), 1)
        latency = self._metrics[c.TOKEN_LATENCY.name].labels(*base)
        for seconds in record.token_latencies_s:
            latency.observe(seconds)
        self._metrics[c.GAMMA.name].labels(*base).set(record.gamma)
        self._metrics[c.MEDUSA_HEADS.name].labels(*base).set(record.heads)
