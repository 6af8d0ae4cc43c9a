"""Engine-wide counters: scrape each pool's ``/metrics`` and republish them with a ``pool`` label.

Kept families (everything else the engine exports stays on the engine's own port):

vLLM V1 (docs.vllm.ai "Metrics" design page; vllm/v1/spec_decode/metrics.py)
    ``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
    ``vllm:spec_decode_num_accepted_tokens_total``,
    ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}``
SGLang (python/sglang/srt/metrics/collector.py, SchedulerMetricsCollector's "Speculative decoding" gauges)
    ``sglang:spec_accept_length``, ``sglang:spec_accept_rate``, and where the build has them the
    active tier of adaptive speculation, ``sglang:spec_num_steps``, ``sglang:spec_num_draft_tokens``
llama.cpp (``llama-server --metrics``; ``server_task_result_metrics::to_metrics`` in
tools/server/server-task.cpp, table in tools/server/README.md)
    ``llamacpp:spec_decode_num_draft_tokens_total``, ``llamacpp:spec_decode_num_accepted_tokens_total``,
    ``llamacpp:spec_decode_num_drafts_total`` (verify steps),
    ``llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position}``, and the throughput
    families ``llamacpp:prompt_*``, ``llamacpp:tokens_predicted_*``,
    ``llamacpp:predicted_tokens_seconds``, ``llamacpp:requests_processing`` /
    ``llamacpp:requests_deferred``
specops serve
    ``specops_*`` engine families, renamed ``specops_engine_*`` (the sidecar exports the
    contract's per-class ``specops_*`` families itself; one name cannot hold both)

A scrape also records each pool's health for ``/readyz``: up when ``/metrics``
answered 200 within the timeout. A pool whose text does not parse keeps its last
good samples and is reported ``parse_error``; a family of an unexpected shape is
skipped — never a crash.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

PREFIXES = {
    "vllm": ("vllm:spec_decode_",),
    "sglang": ("sglang:spec_accept_", "sglang:spec_num_steps", "sglang:spec_num_draft_tokens"),
    "specops": ("specops_",),
    "llamacpp": ("llamacpp:spec_decode_", "llamacpp:prompt_", "llamacpp:tokens_predicted",
                 "llamacpp:predicted_tokens_seconds", "llamacpp:requests_"),
}


class EngineScraper:
    """Scrapes the pools and is itself a collector in the sidecar's registry."""

    def __init__(self, engine: str, upstreams: dict[str, str], *, registry: CollectorRegistry | None = None,
                 timeout_s: float = 2.0) -> None:
        self.engine = engine
        self.upstreams = dict(upstreams)
        self.prefixes = PREFIXES[engine]
        self.timeout_s = timeout_s
        self._families: dict[str, list[Any]] = {}
        self._health: dict[str, dict[str, Any]] = {p: {"up": None, "error": "not scraped yet", "at": None}
                                                   for p in self.upstreams}
        if registry is not None:
            registry.register(self)

    def health(self) -> dict[str, dict[str, Any]]:
        return {p: dict(h) for p, h in self._health.items()}

    def parse(self, pool: str, text: str) -> list[Any]:
        """The kept families of one exposition text (raises ValueError on unparsable text)."""
        kept = []
        for family in text_string_to_metric_families(text):
            if not any(family.name.startswith(p) for p in self.prefixes):
                continue
            if self.engine == "specops" and family.name.startswith("specops_sidecar"):
                continue
            kept.append(family)
        return kept

    async def scrape(self, client: httpx.AsyncClient) -> None:
        for pool, base in self.upstreams.items():
            at = time.time()
            try:
                r = await client.get(base.rstrip("/") + "/metrics", timeout=self.timeout_s)
            except httpx.HTTPError as exc:
                self._health[pool] = {"up": False, "error": type(exc).__name__, "at": at}
                continue
            if r.status_code != 200:
                self._health[pool] = {"up": False, "error": f"/metrics answered {r.status_code}", "at": at}
                continue
            try:
                self._families[pool] = self.parse(pool, r.text)
                self._health[pool] = {"up": True, "error": None, "at": at}
            except (ValueError, TypeError, IndexError) as exc:
                self._health[pool] = {"up": True, "error": f"parse_error: {exc}"[:200], "at": at}

    def public_name(self, name: str) -> str:
        """The republished name (specops engines' families move to ``specops_engine_*``)."""
        if self.engine == "specops" and name.startswith("specops_"):
            return "specops_engine_" + name[len("specops_"):]
        return name

    def collect(self):
        merged: dict[tuple[str, str], Metric] = {}
        for pool, families in self._families.items():
            for fam in families:
                name = self.public_name(fam.name)
                key = (name, fam.type)
                out = merged.get(key)
                if out is None:
                    out = merged[key] = Metric(name, fam.documentation, fam.type)
                for s in fam.samples:
                    if s.name.endswith("_created"):
                        continue
                    out.add_sample(self.public_name(s.name), dict(s.labels, pool=pool), s.value)
        yield from merged.values()
