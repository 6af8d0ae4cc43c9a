"""The telemetry contract: every metric specops exports, and the PromQL derived from them.

The runtime publishes exactly these series (through `PrometheusExporter`); the alert
rules (`specops.alerts.render`), the Grafana dashboard (`specops.alerts.dashboard`) and
the controller's Prometheus source all build their queries from `PROMQL` below, which is
the ONE place the derived series are defined.

Naming follows the Prometheus rules: prefix ``specops_``, base units (seconds), counters
end in ``_total``, ratios are 0–1. Every series carries the labels ``class`` (request
class from the policy) and ``method`` (``ar`` | ``draft`` | ``medusa`` | ``ngram`` | ``eagle``).

Counters (``rate()``/``increase()`` them):

====================================================  ==================================
``specops_requests_total``                            finished requests
``specops_generated_tokens_total``                    new tokens generated
``specops_drafted_tokens_total``                      draft tokens sent to verification
``specops_accepted_tokens_total``                     draft tokens the target accepted
``specops_accepted_tokens_by_position_total``         accepted tokens, label ``position``
``specops_target_forwards_total``                     target model forward passes
``specops_fallbacks_total``                           fallbacks to plain decoding, ``reason``
``specops_medusa_head_predictions_total``             Medusa predictions checked, ``head``
``specops_medusa_head_correct_total``                 Medusa correct predictions, ``head``
``specops_draft_seconds_total``                       seconds spent drafting
``specops_verify_seconds_total``                      seconds spent verifying
``specops_decode_seconds_total``                      seconds taken decoding (wall)
``specops_plain_decode_seconds_estimate_total``       seconds plain decoding would take
====================================================  ==================================

Histogram ``specops_token_latency_seconds`` (per generated token); gauges
``specops_gamma`` (γ in force) and ``specops_medusa_heads`` (heads in use).

Derived series (`PROMQL`, all grouped ``by (class)``; head accuracy ``by (class, head)``)::

    acceptance_rate      sum(rate(accepted_tokens_total)) / sum(rate(drafted_tokens_total))
    speedup              sum(rate(plain_decode_seconds_estimate_total)) / sum(rate(decode_seconds_total))
    head_accuracy        sum(rate(medusa_head_correct_total)) / sum(rate(medusa_head_predictions_total))
    tokens_per_s         sum(rate(generated_tokens_total)) / sum(rate(decode_seconds_total))
    throughput_tokens_per_s  sum(rate(generated_tokens_total))
    mean_accepted_len    sum(rate(generated_tokens_total)) / sum(rate(target_forwards_total))
    p50_token_latency_s  histogram_quantile(0.5, sum by (class, le) (rate(token_latency_seconds_bucket)))
    p99_token_latency_s  histogram_quantile(0.99, ...)
    fallback_rate        sum(rate(fallbacks_total))  (fallbacks per second)
    drafted_tokens       sum(increase(drafted_tokens_total))  (the min-sample volume)
    requests             sum(increase(requests_total))
    accepted_by_position_rate  sum by (class, position) (rate(accepted_tokens_by_position_total))
    gamma, medusa_heads  avg by (class) of the gauges (no window)
"""

from __future__ import annotations

from dataclasses import dataclass
from string import Template

PREFIX = "specops_"
CLASS_LABEL = "class"
METHOD_LABEL = "method"
BASE_LABELS: tuple[str, ...] = (CLASS_LABEL, METHOD_LABEL)


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family."""

    name: str
    """Full family name (counters include the ``_total`` suffix)."""
    kind: str
    """``counter`` | ``gauge`` | ``histogram``."""
    help: str
    """HELP text."""
    labels: tuple[str, ...] = BASE_LABELS
    """Label names, always starting with ``class``, ``method``."""


REQUESTS = MetricSpec("specops_requests_total", "counter", "Finished decode requests.")
GENERATED_TOKENS = MetricSpec("specops_generated_tokens_total", "counter", "New tokens generated.")
DRAFTED_TOKENS = MetricSpec("specops_drafted_tokens_total", "counter", "Draft tokens sent to the target for verification.")
ACCEPTED_TOKENS = MetricSpec("specops_accepted_tokens_total", "counter", "Draft tokens accepted by the target.")
ACCEPTED_BY_POSITION = MetricSpec(
    "specops_accepted_tokens_by_position_total",
    "counter",
    "Accepted draft tokens by draft position (0-based).",
    BASE_LABELS + ("position",),
)
DRAFTED_BY_POSITION = MetricSpec(
    "specops_drafted_tokens_by_position_total",
    "counter",
    "Verification rounds that drafted at least position+1 tokens, by draft position (0-based; "
    "position 0 counts the rounds).",
    BASE_LABELS + ("position",),
)
TARGET_FORWARDS = MetricSpec("specops_target_forwards_total", "counter", "Target model forward passes.")
PLANNED_REQUESTS = MetricSpec(
    "specops_planned_requests_total",
    "counter",
    "Requests whose γ / tree size was an upper bound the runtime planned each round under "
    "(specops serve's engine); the controller does not lower such bounds for cost.",
)
FALLBACKS = MetricSpec(
    "specops_fallbacks_total", "counter", "Requests that fell back to plain decoding, by reason.", BASE_LABELS + ("reason",)
)
HEAD_PREDICTIONS = MetricSpec(
    "specops_medusa_head_predictions_total", "counter", "Medusa head predictions checked, by head (0-based).",
    BASE_LABELS + ("head",),
)
HEAD_CORRECT = MetricSpec(
    "specops_medusa_head_correct_total", "counter", "Medusa head predictions that were correct, by head (0-based).",
    BASE_LABELS + ("head",),
)
DRAFT_SECONDS = MetricSpec("specops_draft_seconds_total", "counter", "Seconds spent drafting.")
VERIFY_SECONDS = MetricSpec("specops_verify_seconds_total", "counter", "Seconds spent in target verification.")
DECODE_SECONDS = MetricSpec("specops_decode_seconds_total", "counter", "Seconds taken decoding (wall clock).")
PLAIN_SECONDS_ESTIMATE = MetricSpec(
    "specops_plain_decode_seconds_estimate_total",
    "counter",
    "Seconds plain decoding would have taken: new tokens x measured single-token target forward seconds.",
)
TOKEN_LATENCY = MetricSpec("specops_token_latency_seconds", "histogram", "Seconds between consecutive generated tokens.")
GAMMA = MetricSpec("specops_gamma", "gauge", "Speculation length (gamma) in force.")
MEDUSA_HEADS = MetricSpec("specops_medusa_heads", "gauge", "Medusa heads in use.")

METRICS: tuple[MetricSpec, ...] = (
    REQUESTS, GENERATED_TOKENS, DRAFTED_TOKENS, ACCEPTED_TOKENS, ACCEPTED_BY_POSITION, DRAFTED_BY_POSITION,
    TARGET_FORWARDS, PLANNED_REQUESTS,
    FALLBACKS, HEAD_PREDICTIONS, HEAD_CORRECT, DRAFT_SECONDS, VERIFY_SECONDS, DECODE_SECONDS,
    PLAIN_SECONDS_ESTIMATE, TOKEN_LATENCY, GAMMA, MEDUSA_HEADS,
)

# Per-token latency buckets (seconds): 1 ms .. 10 s.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


def _rate(name: str) -> str:
    return f"rate({name}{{$match}}[$window])"


def _ratio(num: str, den: str, by: str = "class") -> str:
    return f"sum by ({by}) ({_rate(num)}) / sum by ({by}) ({_rate(den)})"


def _quantile(q: float) -> str:
    return f"histogram_quantile({q}, sum by (class, le) ({_rate(TOKEN_LATENCY.name + '_bucket')}))"


# The derived series. `$window` is a PromQL range (``5m``), `$match` label matchers
# inside the selector braces (empty, or e.g. ``class="code"``). Use `promql()`.
PROMQL: dict[str, str] = {
    "acceptance_rate": _ratio(ACCEPTED_TOKENS.name, DRAFTED_TOKENS.name),
    "speedup": _ratio(PLAIN_SECONDS_ESTIMATE.name, DECODE_SECONDS.name),
    "head_accuracy": _ratio(HEAD_CORRECT.name, HEAD_PREDICTIONS.name, by="class, head"),
    "tokens_per_s": _ratio(GENERATED_TOKENS.name, DECODE_SECONDS.name),
    "throughput_tokens_per_s": f"sum by (class) ({_rate(GENERATED_TOKENS.name)})",
    "mean_accepted_len": _ratio(GENERATED_TOKENS.name, TARGET_FORWARDS.name),
    "p50_token_latency_s": _quantile(0.5),
    "p99_token_latency_s": _quantile(0.99),
    "fallback_rate": f"sum by (class) ({_rate(FALLBACKS.name)})",
    "drafted_tokens": f"sum by (class) (increase({DRAFTED_TOKENS.name}{{$match}}[$window]))",
    "requests": f"sum by (class) (increase({REQUESTS.name}{{$match}}[$window]))",
    "accepted_by_position_rate": f"sum by (class, position) ({_rate(ACCEPTED_BY_POSITION.name)})",
    "gamma": f"avg by (class) ({GAMMA.name}{{$match}})",
    "medusa_heads": f"avg by (class) ({MEDUSA_HEADS.name}{{$match}})",
}

# Which series a policy alert rule's ``metric`` may name (policies.AlertRule.metric).
ALERTABLE = ("acceptance_rate", "speedup", "head_accuracy", "tokens_per_s", "p99_token_latency_s")

# The volume series that guards every alert (AlertRule.min_samples counts drafted tokens).
SAMPLE_SERIES = "drafted_tokens"


def promql(name: str, window: str = "5m", match: str = "") -> str:
    """The PromQL expression of derived series ``name`` over ``window``.

    ``match`` is inserted inside every selector's braces, e.g. ``class="code"`` or
    ``class=~"$class"`` for a Grafana variable.
    """
    if name not in PROMQL:
        raise KeyError(f"unknown derived series {name!r}; known: {', '.join(sorted(PROMQL))}")
    if not window or not (window[0].isdigit() or window.startswith("$")):
        raise ValueError(f"window must be a PromQL duration such as '5m' (or a Grafana variable), got {window!r}")
    expr = Template(PROMQL[name]).substitute(window=window, match=match)
    return expr.replace("{}", "")  # no matchers: plain `name[5m]`


def class_matcher(request_class: str) -> str:
    """A label matcher selecting one request class, with the value escaped for PromQL."""
    escaped = request_class.replace("\\", "\\\\").replace('"', '\\"')
    return f'{CLASS_LABEL}="{escaped}"'
