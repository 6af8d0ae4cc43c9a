"""llama.cpp's llama-server formats: per-request ``timings``, streams, ``/metrics`` (fixtures cite the source)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specops.policies import load_policy
from specops.sidecar import fields
from specops.sidecar.routing import Router
from specops.sidecar.scrape import EngineScraper
from specops.sidecar.stream import StreamWatcher
from specops.sidecar.telemetry import Observation, PoolSpeed, to_record

FIX = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "examples" / "policies" / "default.yaml"


def _json(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def _code_route():
    return Router(load_policy(DEFAULT), {"spec": "http://a", "plain": "http://b"}).route("def f(x):", temperature=0)


def test_llamacpp_timings_give_drafted_accepted_and_engine_times():
    c = fields.extract("llamacpp", _json("llamacpp_response.json"))
    assert (c.drafted, c.accepted, c.predicted_tokens, c.prompt_tokens) == (60, 27, 48, 21)
    assert c.predicted_s == pytest.approx(0.94) and c.prompt_s == pytest.approx(0.042)
    assert c.verify_forwards is None and c.accepted_per_pos == []


def test_llamacpp_timings_without_draft_fields_mean_nothing_drafted():
    body = _json("llamacpp_response.json")
    for key in ("draft_n", "draft_n_accepted"):
        del body["timings"][key]
    c = fields.extract("llamacpp", body)
    assert c is not None and (c.drafted, c.accepted, c.predicted_tokens) == (0, 0, 48)


def test_llamacpp_broken_timing_values_are_dropped_not_the_counts():
    body = _json("llamacpp_response.json")
    body["timings"]["predicted_ms"] = "fast"
    body["timings"]["prompt_ms"] = -1
    c = fields.extract("llamacpp", body)
    assert (c.drafted, c.accepted, c.predicted_s, c.prompt_s) == (60, 27, None, None)


def test_llamacpp_record_uses_engine_decode_time_and_token_count():
    route = _code_route()
    counts = fields.extract("llamacpp", _json("llamacpp_response.json"))
    speed = PoolSpeed(alpha=1.0, min_baseline=1)
    plain_counts = fields.SpecCounts(0, 0, predicted_tokens=41, predicted_s=2.0)
    # not streamed: the wall time includes the prompt pass; the engine's own time does not
    speed.observe("plain", Observation("plain", False, wall_s=2.5, counts=plain_counts))
    assert speed.tps("plain") == pytest.approx(40 / 2.0)
    obs = Observation("spec", True, wall_s=1.0, counts=counts)  # no usage: tokens from predicted_n
    rec = to_record(route, obs, speed.tps("plain"))
    assert (rec.new_tokens, rec.drafted, rec.accepted, rec.accepted_per_pos) == (48, 60, 27, [27])
    assert rec.target_forwards == 48 - 27
    assert rec.verify_s == pytest.approx(0.94) and rec.draft_s == 0.0
    # measured 1.0 s, of which 0.94 s decoding; plain decoding of 47 steps at 20 tokens/s
    assert rec.plain_s_estimate == pytest.approx(1.0 - 0.94 + 47 / 20.0)


def test_llamacpp_stream_final_event_timings_are_read():
    final = {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}], "object": "chat.completion.chunk",
             "timings": _json("llamacpp_response.json")["timings"]}
    w = StreamWatcher("llamacpp", started=0.0)
    w.feed(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n', 0.05)
    w.feed(b'data: {"choices":[{"index":0,"delta":{"content":"def"}}]}\n\n', 0.1)
    w.feed(b'data: {"choices":[{"index":0,"delta":{"content":" add"}}]}\n\n', 0.2)
    w.feed(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n", 0.3)
    assert (w.chunks, w.done, w.malformed, w.usage) == (2, True, 0, None)
    assert (w.counts.drafted, w.counts.accepted, w.counts.predicted_tokens) == (60, 27, 48)
    obs = Observation("spec", True, wall_s=0.3, ttft_s=0.1, decode_s=0.1, chunks=w.chunks, counts=w.counts)
    assert obs.tokens == 48


def test_llamacpp_metrics_republished_with_pool_label():
    registry = CollectorRegistry()
    scraper = EngineScraper("llamacpp", {"spec": "http://a", "plain": "http://b"}, registry=registry)
    text = (FIX / "llamacpp_metrics.txt").read_text()
    scraper._families["spec"] = scraper.parse("spec", text)
    scraper._families["plain"] = scraper.parse("plain", text)
    out = generate_latest(registry).decode()
    names = {f.name for f in text_string_to_metric_families(out)}
    assert {"llamacpp:spec_decode_num_draft_tokens", "llamacpp:spec_decode_num_accepted_tokens",
            "llamacpp:spec_decode_num_drafts", "llamacpp:spec_decode_num_accepted_tokens_per_pos",
            "llamacpp:tokens_predicted", "llamacpp:tokens_predicted_seconds", "llamacpp:prompt_tokens",
            "llamacpp:predicted_tokens_seconds", "llamacpp:requests_processing"} <= names
    assert not names & {"llamacpp:n_decode", "llamacpp:n_busy_slots_per_decode", "llamacpp:n_tokens_max"}
    samples = [s for f in text_string_to_metric_families(out) for s in f.samples]
    assert {s.labels["pool"] for s in samples} == {"spec", "plain"}
    drafted = {s.labels["pool"]: s.value for s in samples if s.name == "llamacpp:spec_decode_num_draft_tokens_total"}
    assert drafted == {"spec": 1200.0, "plain": 1200.0}
    pos = {(s.labels["pool"], s.labels["position"]): s.value for s in samples if "per_pos" in s.name}
    assert pos[("spec", "2")] == 110.0
