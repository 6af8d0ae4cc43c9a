"""Where the controller reads metric windows from: Redis buckets or Prometheus.

Every source answers ``window(request_class, seconds) -> WindowStats | None``. None
means *inconclusive*: the source is unreachable, answered garbage, or has no traffic
for the class in the window. It is never a pass or a failure. ``read`` says which of
the two it was (``error`` is set when the source failed), which the rollout analysis
needs to tell Error from Inconclusive runs.

The vLLM and SGLang adapters live in :mod:`specops.controller.engine_sources`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import requests

from specops.telemetry import contract
from specops.telemetry.records import WindowStats

log = logging.getLogger(__name__)


@dataclass
class SourceWindow(WindowStats):
    """A window from a source that may lack some series.

    ``timed`` is False when the source has no decode/plain timing (an engine adapter):
    then ``speedup`` and ``tokens_per_s`` are None (unknown), not 0. ``direct`` carries
    ratios the source reports ready-made (vLLM V0 / SGLang gauges), overriding the
    ones computed from counts.
    """

    timed: bool = True
    p99_token_latency_s: float | None = None
    direct: dict[str, float] = field(default_factory=dict)

    def _pick(self, name: str, computed: float | None) -> float | None:
        return self.direct.get(name, computed)

    @property
    def acceptance_rate(self) -> float | None:  # type: ignore[override]
        if "acceptance_rate" in self.direct:
            return self.direct["acceptance_rate"]
        return self.accepted / self.drafted if self.drafted else None

    @property
    def speedup(self) -> float | None:  # type: ignore[override]
        return self._pick("speedup", WindowStats.speedup.fget(self) if self.timed and self.wall_s > 0 else None)

    @property
    def tokens_per_s(self) -> float | None:  # type: ignore[override]
        return self._pick("tokens_per_s", WindowStats.tokens_per_s.fget(self) if self.timed and self.wall_s > 0 else None)

    @property
    def mean_accepted_len(self) -> float | None:  # type: ignore[override]
        return self._pick("mean_accepted_len", WindowStats.mean_accepted_len.fget(self) if self.target_forwards else None)


@dataclass(frozen=True)
class Reading:
    """A source's answer: the window (None = inconclusive) and, if it failed, why."""

    stats: WindowStats | None
    error: str | None = None


class MetricSource(Protocol):
    """Anything the controller can read windows from."""

    name: str

    def window(self, request_class: str, seconds: float) -> WindowStats | None: ...

    def read(self, request_class: str, seconds: float) -> Reading: ...


def read_many(source: MetricSource, classes: Iterable[str], seconds: float) -> dict[str, Reading]:
    """Readings for several classes, in one round trip when the source supports it.

    A source that raises instead of reporting its failure in a `Reading` makes every
    class inconclusive for this tick (never pass or fail), with the error logged."""
    names = list(classes)
    batch = getattr(source, "read_many", None)
    try:
        if batch is not None:
            return batch(names, seconds)
        return {name: source.read(name, seconds) for name in names}
    except Exception as exc:  # noqa: BLE001 - any source failure is "no data", not a crash of the tick
        error = f"{getattr(source, 'name', type(source).__name__)} source failed: {type(exc).__name__}: {exc}"
        log.warning("%s", error)
        return {name: Reading(None, error) for name in names}


def _usable(stats: WindowStats | None, min_requests: int) -> WindowStats | None:
    if stats is None or stats.requests < max(1, min_requests):
        return None
    return stats


class RedisWindowSource:
    """Fleet-wide windows from the bucketed Redis counters (`RedisWindowReader`)."""

    def __init__(self, reader, *, min_requests: int = 1, name: str = "redis") -> None:
        self.reader = reader
        self.min_requests = min_requests
        self.name = name

    def read_many(self, classes: list[str], seconds: float) -> dict[str, Reading]:
        import redis  # the client library is a core dependency; imported here to keep the module light

        try:
            windows = self.reader.windows(classes, seconds)
        except (redis.RedisError, OSError) as exc:
            log.warning("redis metric source unavailable: %s", exc)
            return {c: Reading(None, f"redis: {exc}") for c in classes}
        return {c: Reading(_usable(windows.get(c), self.min_requests)) for c in classes}

    def read(self, request_class: str, seconds: float) -> Reading:
        return self.read_many([request_class], seconds)[request_class]

    def window(self, request_class: str, seconds: float) -> WindowStats | None:
        return self.read(request_class, seconds).stats


# (field of WindowStats, metric family, extra label to group by)
_PROM_SERIES: tuple[tuple[str, str, str | None], ...] = (
    ("requests", contract.REQUESTS.name, None),
    ("new_tokens", contract.GENERATED_TOKENS.name, None),
    ("drafted", contract.DRAFTED_TOKENS.name, None),
    ("accepted", contract.ACCEPTED_TOKENS.name, None),
    ("accepted_per_pos", contract.ACCEPTED_BY_POSITION.name, "position"),
    ("drafted_per_pos", contract.DRAFTED_BY_POSITION.name, "position"),
    ("target_forwards", contract.TARGET_FORWARDS.name, None),
    ("planned", contract.PLANNED_REQUESTS.name, None),
    ("draft_s", contract.DRAFT_SECONDS.name, None),
    ("verify_s", contract.VERIFY_SECONDS.name, None),
    ("wall_s", contract.DECODE_SECONDS.name, None),
    ("plain_s_estimate", contract.PLAIN_SECONDS_ESTIMATE.name, None),
    ("head_predictions", contract.HEAD_PREDICTIONS.name, "head"),
    ("head_correct", contract.HEAD_CORRECT.name, "head"),
)
_FIELD_LABEL = "specops_field"
_INT_FIELDS = {"requests", "new_tokens", "drafted", "accepted", "target_forwards", "planned"}


def prometheus_duration(seconds: float) -> str:
    """A PromQL range duration for ``seconds`` (whole seconds, at least 1s)."""
    if seconds <= 0:
        raise ValueError(f"window must be positive, got {seconds}")
    return f"{max(1, round(seconds))}s"


_MATCHER = re.compile(r'\s*[A-Za-z_][A-Za-z0-9_]*\s*(=|!=|=~|!~)\s*"(?:[^"\\]|\\.)*"\s*')


def check_matchers(match: str) -> str:
    """``match`` if it is a comma-separated list of PromQL label matchers (``track="canary"``); else ValueError."""
    if not match.strip() or not all(_MATCHER.fullmatch(part) for part in _split_matchers(match)):
        raise ValueError(f'expected PromQL label matchers such as track="canary", got {match!r}')
    return match.strip()


def _split_matchers(match: str) -> list[str]:
    parts, current, quoted, escaped = [], "", False, False
    for ch in match:
        if ch == "," and not quoted:
            parts.append(current)
            current = ""
            continue
        current += ch
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
    return [*parts, current]


def window_query(request_class: str, seconds: float, match: str = "") -> str:
    """ONE PromQL query returning every counter increase of a class over the window.

    Each counter's increase is tagged with a ``specops_field`` label (``label_replace``)
    and the parts are joined with ``or``, so a window costs one HTTP request. The p99
    token latency comes from the contract's derived series. ``match``: more label
    matchers for every selector (e.g. the canary's ``track="canary"``).
    """
    window = prometheus_duration(seconds)
    match = contract.class_matcher(request_class) + (f", {check_matchers(match)}" if match else "")
    parts = []
    for field_name, metric, extra in _PROM_SERIES:
        by = "class" if extra is None else f"class, {extra}"
        inner = f"sum by ({by}) (increase({metric}{{{match}}}[{window}]))"
        parts.append(f'label_replace({inner}, "{_FIELD_LABEL}", "{field_name}", "", "")')
    p99 = contract.promql("p99_token_latency_s", window, match)
    parts.append(f'label_replace({p99}, "{_FIELD_LABEL}", "p99_token_latency_s", "", "")')
    return " or ".join(parts)


def parse_window_result(result: list[dict]) -> SourceWindow:
    """Build a window from the ``data.result`` vector of :func:`window_query`."""
    scalars: dict[str, float] = {}
    indexed: dict[str, dict[int, float]] = {"accepted_per_pos": {}, "drafted_per_pos": {}, "head_predictions": {},
                                            "head_correct": {}}
    p99: float | None = None
    for sample in result:
        labels = sample.get("metric", {})
        name = labels.get(_FIELD_LABEL)
        try:
            value = float(sample["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            raise ValueError(f"malformed sample in Prometheus result: {sample!r}") from None
        if value != value:  # NaN (e.g. a quantile of no observations)
            continue
        if name == "p99_token_latency_s":
            p99 = value
        elif name in indexed:
            key = "position" if name.endswith("_per_pos") else "head"
            try:
                idx = int(labels[key])
            except (KeyError, ValueError):
                raise ValueError(f"sample of {name} without a numeric {key!r} label: {labels!r}") from None
            indexed[name][idx] = indexed[name].get(idx, 0.0) + value
        elif name is not None:
            scalars[name] = scalars.get(name, 0.0) + value

    def ints(counts: dict[int, float]) -> list[int]:
        return [round(counts.get(i, 0.0)) for i in range(max(counts) + 1)] if counts else []

    preds, corrs = ints(indexed["head_predictions"]), ints(indexed["head_correct"])
    n_heads = max(len(preds), len(corrs))
    preds += [0] * (n_heads - len(preds))
    corrs += [0] * (n_heads - len(corrs))
    return SourceWindow(
        requests=round(scalars.get("requests", 0.0)),
        new_tokens=round(scalars.get("new_tokens", 0.0)),
        drafted=round(scalars.get("drafted", 0.0)),
        accepted=round(scalars.get("accepted", 0.0)),
        accepted_per_pos=ints(indexed["accepted_per_pos"]),
        drafted_per_pos=ints(indexed["drafted_per_pos"]),
        target_forwards=round(scalars.get("target_forwards", 0.0)),
        planned=round(scalars.get("planned", 0.0)),
        draft_s=scalars.get("draft_s", 0.0),
        verify_s=scalars.get("verify_s", 0.0),
        wall_s=scalars.get("wall_s", 0.0),
        plain_s_estimate=scalars.get("plain_s_estimate", 0.0),
        head_predictions=preds,
        head_correct=corrs,
        p99_token_latency_s=p99,
    )


class PrometheusSource:
    """Windows through Prometheus's HTTP query API (``GET /api/v1/query``).

    ``match``: label matchers added to every selector, e.g. ``track="canary"`` to read
    only the canary revision's series (as an Argo Rollouts AnalysisTemplate selects
    the canary's pods by label).
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0, min_requests: int = 1,
                 session: requests.Session | None = None, clock: Callable[[], float] | None = None,
                 name: str = "prometheus", match: str = "") -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Prometheus URL must start with http:// or https://, got {url!r}")
        self.match = check_matchers(match) if match else ""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.min_requests = min_requests
        self.session = session or requests.Session()
        self.clock = clock  # None: Prometheus evaluates at its own "now"
        self.name = name

    def query(self, expr: str) -> list[dict]:
        """Run an instant query; raise ``RuntimeError`` on any failure."""
        params = {"query": expr}
        if self.clock is not None:
            params["time"] = f"{self.clock():.3f}"
        try:
            resp = self.session.get(f"{self.url}/api/v1/query", params=params, timeout=self.timeout_s)
            body = resp.json()
        except (requests.RequestException, ValueError) as exc:
            raise RuntimeError(f"prometheus query failed: {exc}") from exc
        if resp.status_code != 200 or body.get("status") != "success":
            raise RuntimeError(f"prometheus answered {resp.status_code}: {body.get('error', body)!r}"[:300])
        data = body.get("data", {})
        if data.get("resultType") != "vector":
            raise RuntimeError(f"expected a vector result, got {data.get('resultType')!r}")
        return data.get("result", [])

    def read(self, request_class: str, seconds: float) -> Reading:
        started = time.perf_counter()
        try:
            stats = parse_window_result(self.query(window_query(request_class, seconds, self.match)))
        except (RuntimeError, ValueError) as exc:
            log.warning("prometheus source: class %s: %s", request_class, exc)
            return Reading(None, str(exc))
        log.debug("prometheus window for %s in %.1f ms", request_class, (time.perf_counter() - started) * 1e3)
        return Reading(_usable(stats, self.min_requests))

    def window(self, request_class: str, seconds: float) -> WindowStats | None:
        return self.read(request_class, seconds).stats


class CombinedSource:
    """The first source with data wins (e.g. Redis, then Prometheus).

    A class no source had data for carries the errors of the sources that failed: an
    empty Redis does not prove there is no data when Prometheus could not be asked, so
    the reading is *unreachable*, not "no traffic".
    """

    def __init__(self, sources: list[MetricSource], name: str = "combined") -> None:
        if not sources:
            raise ValueError("CombinedSource needs at least one source")
        self.sources = sources
        self.name = name

    def read_many(self, classes: list[str], seconds: float) -> dict[str, Reading]:
        out: dict[str, Reading] = {}
        pending = list(classes)
        errors: dict[str, list[str]] = {c: [] for c in classes}
        for source in self.sources:
            if not pending:
                break
            for c, reading in read_many(source, pending, seconds).items():
                if reading.stats is not None:
                    out[c] = reading
                elif reading.error:
                    errors[c].append(f"{source.name}: {reading.error}")
            pending = [c for c in pending if c not in out]
        for c in pending:
            # some source failed -> unreachable (its data is unknown); all answered empty -> no traffic
            out[c] = Reading(None, "; ".join(errors[c]) or None)
        return out

    def read(self, request_class: str, seconds: float) -> Reading:
        return self.read_many([request_class], seconds)[request_class]

    def window(self, request_class: str, seconds: float) -> WindowStats | None:
        return self.read(request_class, seconds).stats
