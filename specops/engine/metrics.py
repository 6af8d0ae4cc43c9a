"""Serving metrics, beside the per-request telemetry contract (`specops.telemetry.contract`).

=============================================  =========  ==========================================
``specops_serving_requests_total``             counter    finished HTTP generations, ``status``
                                                          (ok | aborted | error | rejected)
``specops_serving_ttft_seconds``               histogram  arrival → first token, ``class``
``specops_serving_itl_seconds``                histogram  between successive token deliveries, ``class``
``specops_serving_e2e_seconds``                histogram  arrival → last token, ``class``
``specops_serving_output_tokens_total``        counter    tokens streamed, ``class`` (rate() = tokens/s)
``specops_serving_prompt_tokens_total``        counter    prompt tokens admitted, ``class``
``specops_serving_queue_length``               gauge      requests waiting in the engine
``specops_serving_running``                    gauge      requests running in the engine
``specops_serving_batch_size``                 gauge      sequences in the last step's forward
``specops_serving_kv_blocks_used`` / ``_free``  gauge      paged KV cache blocks
``specops_serving_inflight``                   gauge      admitted requests not yet finished
``specops_serving_decode_steps``               gauge      decode steps since start, ``kind`` (spec: some
                                                          sequence speculated | plain)
``specops_serving_planner_events``             gauge      the planner's interventions since start, ``event``
                                                          (veto | probe | plain_probe)
``specops_serving_policy_stale``               gauge      1 while the policy state is not live
``specops_serving_policy_age_seconds``         gauge      since the last successful policy load
``specops_serving_policy_refresh_failures``    gauge      failed policy refreshes since start
``specops_serving_records_buffered``           gauge      telemetry records waiting for Redis
``specops_serving_records_dropped``            gauge      records dropped because the buffer was full
=============================================  =========  ==========================================

PromQL: per-class tokens/s ``sum by (class) (rate(specops_serving_output_tokens_total[1m]))``;
p99 TTFT ``histogram_quantile(0.99, sum by (le) (rate(specops_serving_ttft_seconds_bucket[5m])))``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class KvBlocks:
    """``specops_serving_kv_blocks_used`` and ``_free`` from one snapshot.

    The engine thread replaces the (used, free) pair in one assignment and a scrape reads
    the pair once, so a scrape never shows ``used`` of one step beside ``free`` of another
    (two separate gauges can: their sum then exceeds the pool).
    """

    def __init__(self) -> None:
        self.snapshot: tuple[int, int] = (0, 0)

    def collect(self) -> Any:
        used, free = self.snapshot
        yield GaugeMetricFamily("specops_serving_kv_blocks_used", "Paged KV blocks in use.", value=used)
        yield GaugeMetricFamily("specops_serving_kv_blocks_free", "Paged KV blocks free.", value=free)


class ServingMetrics:
    """The serving families above, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("specops_serving_requests", "Finished HTTP generations by status.", ["status"],
                                registry=registry)
        self.ttft = Histogram("specops_serving_ttft_seconds", "Seconds from arrival to the first token.", ["class"],
                              buckets=LATENCY_BUCKETS_S, registry=registry)
        self.itl = Histogram("specops_serving_itl_seconds", "Seconds between successive token deliveries.", ["class"],
                             buckets=LATENCY_BUCKETS_S, registry=registry)
        self.e2e = Histogram("specops_serving_e2e_seconds", "Seconds from arrival to the last token.", ["class"],
                             buckets=LATENCY_BUCKETS_S, registry=registry)
        self.output_tokens = Counter("specops_serving_output_tokens", "Tokens streamed to clients.", ["class"],
                                     registry=registry)
        self.prompt_tokens = Counter("specops_serving_prompt_tokens", "Prompt tokens admitted.", ["class"],
                                     registry=registry)
        self.queue_length = Gauge("specops_serving_queue_length", "Requests waiting in the engine.", registry=registry)
        self.running = Gauge("specops_serving_running", "Requests running in the engine.", registry=registry)
        self.batch_size = Gauge("specops_serving_batch_size", "Sequences in the last step.", registry=registry)
        self.kv_blocks = KvBlocks()
        registry.register(self.kv_blocks)
        self.prefix_hits = Gauge("specops_serving_prefix_cache_hit_blocks", "KV blocks reused from the prefix cache "
                                 "since start (prompt blocks not recomputed).", registry=registry)
        self.prefix_deferrals = Gauge("specops_serving_prefix_deferrals", "Admissions put off one step since start "
                                      "to reuse prompt blocks another request admitted in the same step was "
                                      "computing.", registry=registry)
        self.decode_steps = Gauge("specops_serving_decode_steps", "Decode steps since start: kind=spec where some "
                                  "sequence speculated, plain where none did.", ["kind"], registry=registry)
        self.planner_events = Gauge("specops_serving_planner_events", "The speculation planner's interventions since "
                                    "start: veto (speculation stopped at a batch size where it was measured slower), "
                                    "probe (one sequence speculated against the plan), plain_probe (a plain step at a "
                                    "batch size that always speculated).", ["event"], registry=registry)
        self.medusa_branches = Gauge("specops_serving_medusa_branch_steps", "Greedy Medusa steps since start whose "
                                     "tree carried a prompt-lookup branch.", registry=registry)
        self.medusa_branch_tokens = Gauge("specops_serving_medusa_branch_tokens", "Tokens accepted since start on "
                                          "prompt-lookup branch nodes the heads' tree did not hold.", registry=registry)
        self.inflight = Gauge("specops_serving_inflight", "Admitted requests not yet finished.", registry=registry)
        self.policy_stale = Gauge("specops_serving_policy_stale", "1 while the policy state is not live (Redis "
                                  "unreachable or empty): the last known settings serve.", registry=registry)
        self.policy_age = Gauge("specops_serving_policy_age_seconds", "Seconds since the last successful policy load.",
                                registry=registry)
        self.policy_failures = Gauge("specops_serving_policy_refresh_failures", "Failed policy refreshes since start.",
                                     registry=registry)
        self.records_buffered = Gauge("specops_serving_records_buffered", "Telemetry records waiting for Redis.",
                                      registry=registry)
        self.records_dropped = Gauge("specops_serving_records_dropped", "Telemetry records dropped (buffer full).",
                                     registry=registry)

    def engine(self, stats: Any) -> None:
        """Copy an `EngineStats` snapshot into the gauges."""
        self.queue_length.set(stats.waiting)
        self.running.set(stats.running)
        self.batch_size.set(stats.batch_size)
        self.kv_blocks.snapshot = (stats.kv_blocks_used, stats.kv_blocks_free)
        self.prefix_hits.set(stats.prefix_cache_hit_blocks)
        self.prefix_deferrals.set(stats.prefix_deferrals)
        self.decode_steps.labels("spec").set(stats.spec_steps)
        self.decode_steps.labels("plain").set(stats.plain_steps)
        for event, value in (("veto", stats.vetoes), ("probe", stats.probes), ("plain_probe", stats.plain_probes)):
            self.planner_events.labels(event).set(value)
        self.medusa_branches.set(stats.medusa_branches)
        self.medusa_branch_tokens.set(stats.medusa_branch_tokens)

    def policy(self, live: Any, records: Any) -> None:
        """Copy the fail-static state (`LivePolicy`, `RecordBuffer`) into the gauges."""
        if live is not None:
            self.policy_stale.set(1 if live.stale else 0)
            age = live.age_s()
            self.policy_age.set(-1 if age is None else age)
            self.policy_failures.set(live.failures_total)
        self.records_buffered.set(len(records))
        self.records_dropped.set(records.dropped)
