"""Per-turn Prometheus series, exported only when a policy sets ``telemetry.turn_label``.

The contract's metric families (``contract.py``) keep their ``class`` / ``method``
labels unchanged; these extra counters add a ``turn`` label whose values are bounded
to ``1`` / ``2`` / ``3+`` (`turn_bucket`), so per-turn
acceptance is visible without unbounded cardinality::

    sum by (class, turn) (rate(specops_turn_accepted_tokens_total[5m]))
      / sum by (class, turn) (rate(specops_turn_drafted_tokens_total[5m]))

Requests whose turn is unknown are not counted here (they still count in the
contract's families).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from specops.telemetry.records import DecodeRecord

TURN_LABELS = ("class", "method", "turn")
TURN_BUCKETS = ("1", "2", "3+")
"""Every value the telemetry ``turn`` label can take."""


def turn_bucket(turn: int | None) -> str | None:
    """The bounded telemetry label for ``turn``: ``1``, ``2`` or ``3+`` (None stays None)."""
    if turn is None:
        return None
    return TURN_BUCKETS[min(turn, 3) - 1]


class TurnExporter:
    """Counts requests, generated / drafted / accepted tokens and decode seconds per turn bucket."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("specops_turn_requests", "Finished decode requests by conversation turn.",
                                TURN_LABELS, registry=self.registry)
        self.generated = Counter("specops_turn_generated_tokens", "New tokens generated, by conversation turn.",
                                 TURN_LABELS, registry=self.registry)
        self.drafted = Counter("specops_turn_drafted_tokens", "Draft tokens verified, by conversation turn.",
                               TURN_LABELS, registry=self.registry)
        self.accepted = Counter("specops_turn_accepted_tokens", "Draft tokens accepted, by conversation turn.",
                                TURN_LABELS, registry=self.registry)
        self.seconds = Counter("specops_turn_decode_seconds", "Decode wall seconds, by conversation turn.",
                               TURN_LABELS, registry=self.registry)

    def observe(self, record: DecodeRecord, turn: int | None) -> str | None:
        """Account one finished request; returns the turn label used (None: not counted)."""
        bucket = turn_bucket(turn)
        if bucket is None:
            return None
        labels = (record.request_class, record.method, bucket)
        self.requests.labels(*labels).inc()
        self.generated.labels(*labels).inc(record.new_tokens)
        self.drafted.labels(*labels).inc(record.drafted)
        self.accepted.labels(*labels).inc(record.accepted)
        self.seconds.labels(*labels).inc(record.wall_s)
        return bucket
