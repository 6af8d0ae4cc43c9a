"""Metric-source adapters for pods that run vLLM or SGLang instead of the specops runtime.

Both engines expose Prometheus text on ``/metrics``. The adapter scrapes each pod of
a class, keeps a short history of scrapes, and turns the counter increase between
the oldest scrape inside the window and the newest one into a
:class:`~specops.controller.sources.SourceWindow`. Engines do not report decode
timing against a plain-decoding baseline, so these windows are *untimed*: speed-up
and tokens/s are unknown (None → rules on them are inconclusive), acceptance and
accepted length are known.

vLLM V1 counters: ``vllm:spec_decode_num_drafts_total`` (verification rounds),
``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}``. vLLM V0 gauges:
``vllm:spec_decode_draft_acceptance_rate``, ``vllm:spec_decode_efficiency``.
SGLang gauges: ``sglang:spec_accept_length`` (tokens per verify step, bonus
included), ``sglang:spec_accept_rate``.

`engine_sources` builds the adapters from ``specops controller run --engine-metrics``
specs, ``ENGINE=URL`` or ``ENGINE:CLASS=URL``. An engine's metrics are pod-wide (not
per request class), so a URL given without a class counts for every class.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import requests
from prometheus_client.parser import text_string_to_metric_families

from specops.controller.sources import Reading, SourceWindow
from specops.telemetry.records import WindowStats

log = logging.getLogger(__name__)

Fetch = Callable[[str], str]  # URL -> exposition text; raises on failure
ALL_CLASSES = "*"  # endpoints key: pods whose metrics count for every request class


@dataclass(frozen=True)
class Scrape:
    """One pod's parsed exposition at one time: sample name -> summed value, per label key."""

    at: float
    values: dict[tuple[str, str], float]  # (sample name, "position=3" or "") -> value

    def get(self, name: str, key: str = "") -> float | None:
        return self.values.get((name, key))

    def indexed(self, name: str, label: str) -> dict[int, float]:
        out: dict[int, float] = {}
        prefix = f"{label}="
        for (sample, key), value in self.values.items():
            if sample == name and key.startswith(prefix):
                try:
                    out[int(key[len(prefix):])] = value
                except ValueError:
                    continue
        return out


def parse_exposition(text: str, at: float, keep_label: dict[str, str]) -> Scrape:
    """Parse Prometheus text; sum samples over all labels except ``keep_label[name]``.

    Raises ``ValueError`` on text that is not valid exposition format.
    """
    values: dict[tuple[str, str], float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises several types on bad input
        raise ValueError(f"not Prometheus exposition text: {exc}") from exc
    for family in families:
        for sample in family.samples:
            label = keep_label.get(sample.name)
            key = f"{label}={sample.labels[label]}" if label and label in sample.labels else ""
            if math.isnan(sample.value):
                continue
            values[(sample.name, key)] = values.get((sample.name, key), 0.0) + sample.value
    return Scrape(at, values)


def http_fetch(timeout_s: float = 3.0) -> Fetch:
    session = requests.Session()

    def fetch(url: str) -> str:
        resp = session.get(url, timeout=timeout_s)
        resp.raise_for_status()
        return resp.text

    return fetch


@dataclass
class _PodHistory:
    scrapes: deque = field(default_factory=lambda: deque(maxlen=512))


class EngineSource:
    """Scrapes engine pods per class and builds windows from counter deltas."""

    name = "engine"
    keep_label: dict[str, str] = {}

    def __init__(self, endpoints: dict[str, list[str]], *, fetch: Fetch | None = None,
                 clock: Callable[[], float] = time.time, min_requests: int = 1) -> None:
        for cls, urls in endpoints.items():
            if not urls:
                raise ValueError(f"class {cls!r} has no endpoints")
        self.endpoints = endpoints
        self.fetch = fetch or http_fetch()
        self.clock = clock
        self.min_requests = min_requests
        self._history: dict[str, _PodHistory] = {}

    def urls(self, request_class: str) -> list[str]:
        """The pods scraped for a class: its own, else those for every class."""
        return self.endpoints.get(request_class) or self.endpoints.get(ALL_CLASSES, [])

    def scrape(self, request_class: str) -> list[str]:
        """Scrape every pod of the class now; return the errors."""
        errors = []
        now = self.clock()
        for url in self.urls(request_class):
            try:
                scrape = parse_exposition(self.fetch(url), now, self.keep_label)
            except Exception as exc:  # network or parse failure of one pod: inconclusive for it
                errors.append(f"{url}: {exc}")
                continue
            self._history.setdefault(url, _PodHistory()).scrapes.append(scrape)
        return errors

    def _pair(self, url: str, since: float) -> tuple[Scrape, Scrape] | None:
        hist = self._history.get(url)
        if hist is None or not hist.scrapes:
            return None
        newest = hist.scrapes[-1]
        older = [s for s in hist.scrapes if s.at <= since]
        oldest = older[-1] if older else hist.scrapes[0]
        return oldest, newest

    def read(self, request_class: str, seconds: float) -> Reading:
        urls = self.urls(request_class)
        if not urls:
            return Reading(None)
        errors = self.scrape(request_class)
        since = self.clock() - seconds
        total: WindowStats | None = None
        for url in urls:
            pair = self._pair(url, since)
            if pair is None:
                continue
            part = self.window_between(*pair)
            if part is not None:
                total = part if total is None else self._merge(total, part)
        if total is None:
            return Reading(None, "; ".join(errors) if len(errors) == len(urls) else None)
        return Reading(total if total.requests >= self.min_requests else None)

    def window(self, request_class: str, seconds: float) -> WindowStats | None:
        return self.read(request_class, seconds).stats

    def window_between(self, old: Scrape, new: Scrape) -> SourceWindow | None:
        raise NotImplementedError

    @staticmethod
    def _merge(a: SourceWindow, b: SourceWindow) -> SourceWindow:
        merged = WindowStats.merge(a, b)
        direct = {}
        for key in set(a.direct) | set(b.direct):
            wa, wb = max(a.requests, 1 if key in a.direct else 0), max(b.requests, 1 if key in b.direct else 0)
            va, vb = a.direct.get(key, 0.0), b.direct.get(key, 0.0)
            direct[key] = (va * wa * (key in a.direct) + vb * wb * (key in b.direct)) / max(
                wa * (key in a.direct) + wb * (key in b.direct), 1)
        return SourceWindow(**merged.__dict__, timed=False, direct=direct)


def _delta(old: Scrape, new: Scrape, name: str, key: str = "") -> float | None:
    """Counter increase between two scrapes (None: unknown; a reset counts from zero)."""
    if old is new:
        return None  # one scrape is no window: wait for the next one
    a, b = old.get(name, key), new.get(name, key)
    if b is None:
        return None
    if a is None or b < a:  # the series appeared, or the counter reset (pod restart)
        return b
    return b - a


class VllmSource(EngineSource):
    """vLLM pods: V1 spec-decode counters, falling back to the V0 gauges."""

    name = "vllm"
    DRAFTS = "vllm:spec_decode_num_drafts_total"
    DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
    ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
    PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    V0_ACCEPTANCE = "vllm:spec_decode_draft_acceptance_rate"
    V0_EFFICIENCY = "vllm:spec_decode_efficiency"
    keep_label = {PER_POS: "position"}

    def window_between(self, old: Scrape, new: Scrape) -> SourceWindow | None:
        drafts = _delta(old, new, self.DRAFTS)
        drafted = _delta(old, new, self.DRAFT_TOKENS)
        accepted = _delta(old, new, self.ACCEPTED)
        if drafts is not None and drafted is not None and accepted is not None:
            per_new, per_old = new.indexed(self.PER_POS, "position"), old.indexed(self.PER_POS, "position")
            per_pos = {i: v - per_old.get(i, 0.0) if v >= per_old.get(i, 0.0) else v for i, v in per_new.items()}
            positions = [round(per_pos.get(i, 0.0)) for i in range(max(per_pos) + 1)] if per_pos else []
            rounds = round(drafts)
            return SourceWindow(
                requests=rounds,  # vLLM counts verification rounds, not requests
                new_tokens=round(accepted) + rounds,  # each round emits the accepted tokens + one
                drafted=round(drafted),
                accepted=round(accepted),
                accepted_per_pos=positions,
                target_forwards=rounds,
                gamma=drafted / drafts if drafts else 0.0,
                timed=False,
            )
        rate = new.get(self.V0_ACCEPTANCE)
        if rate is None:
            return None
        direct = {"acceptance_rate": rate}
        efficiency = new.get(self.V0_EFFICIENCY)
        if efficiency is not None:
            direct["efficiency"] = efficiency
        # V0 gauges carry no volume: one "request" marks the pod as reporting; drafted stays 0,
        # so rules with min_samples > 0 stay inconclusive on V0 data.
        return SourceWindow(requests=1, timed=False, direct=direct)


class SglangSource(EngineSource):
    """SGLang pods: ``sglang:spec_accept_length`` / ``sglang:spec_accept_rate`` gauges."""

    name = "sglang"
    ACCEPT_LENGTH = "sglang:spec_accept_length"
    ACCEPT_RATE = "sglang:spec_accept_rate"
    GENERATION_TOKENS = "sglang:generation_tokens_total"

    def window_between(self, old: Scrape, new: Scrape) -> SourceWindow | None:
        length, rate = new.get(self.ACCEPT_LENGTH), new.get(self.ACCEPT_RATE)
        if length is None and rate is None:
            return None
        direct: dict[str, float] = {}
        if length is not None:
            direct["mean_accepted_len"] = length
        if rate is not None:
            direct["acceptance_rate"] = rate
        tokens = _delta(old, new, self.GENERATION_TOKENS)
        new_tokens = round(tokens) if tokens is not None else 0
        forwards = round(new_tokens / length) if length and new_tokens else 0
        # accepted draft tokens per verify step = accept_length - 1 (the bonus token is not a draft)
        accepted = round(forwards * max(0.0, length - 1.0)) if length and forwards else 0
        drafted = round(accepted / rate) if rate and accepted else 0
        return SourceWindow(requests=1, new_tokens=new_tokens, target_forwards=forwards, accepted=accepted,
                            drafted=drafted, timed=False, direct=direct)


ENGINES: dict[str, type[EngineSource]] = {"vllm": VllmSource, "sglang": SglangSource}


def engine_sources(specs: Sequence[str], *, fetch: Fetch | None = None,
                   clock: Callable[[], float] = time.time) -> list[EngineSource]:
    """One source per engine from ``ENGINE=URL`` / ``ENGINE:CLASS=URL`` specs (URL: the pod's
    ``/metrics``); raise ``ValueError`` naming a bad spec."""
    endpoints: dict[str, dict[str, list[str]]] = {}
    for spec in specs:
        head, sep, url = spec.partition("=")
        engine, _, request_class = head.partition(":")
        engine = engine.strip().lower()
        if not sep or engine not in ENGINES:
            raise ValueError(f"{spec!r}: expected ENGINE=URL or ENGINE:CLASS=URL with ENGINE one of "
                             f"{', '.join(sorted(ENGINES))}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{spec!r}: the URL must start with http:// or https://")
        endpoints.setdefault(engine, {}).setdefault(request_class.strip() or ALL_CLASSES, []).append(url)
    return [ENGINES[engine](by_class, fetch=fetch, clock=clock) for engine, by_class in endpoints.items()]
