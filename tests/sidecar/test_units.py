"""Engine formats (fixtures of vLLM / SGLang fields and /metrics), routing, records, policy pools."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specops.policies import PolicyError, load_policy
from specops.policies.rollout import effective_for
from specops.sidecar import fields
from specops.sidecar.routing import REASON_FALLBACK, REASON_OFF, REASON_TEMPERATURE, Router
from specops.sidecar.scrape import EngineScraper
from specops.sidecar.telemetry import Observation, PoolSpeed, to_record

FIX = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "examples" / "policies" / "default.yaml"


def _json(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def test_vllm_per_request_fields():
    c = fields.extract("vllm", _json("vllm_response.json"))
    assert (c.drafted, c.accepted, c.verify_forwards, c.gamma) == (129, 10, 43, 3)
    # histogram [39, 1, 0, 3]: position 0 accepted in 4 steps, 1 in 3, 2 in 3
    assert c.accepted_per_pos == [4, 3, 3]
    assert fields.completion_tokens(_json("vllm_response.json")) == 53


def test_sglang_meta_info_fields():
    c = fields.extract("sglang", _json("sglang_response.json"))
    assert (c.drafted, c.accepted, c.verify_forwards) == (48, 24, 16)
    explicit = {"meta_info": {"spec_verify_ct": 4, "spec_accept_token_num": 6, "spec_draft_token_num": 12}}
    c2 = fields.extract("sglang", explicit)
    assert (c2.drafted, c2.accepted, c2.gamma) == (12, 6, 3)


@pytest.mark.parametrize("fixture", ["sglang_response_drafts.json", "sglang_response_num_drafts.json"])
def test_sglang_renamed_counts_and_histogram(fixture):
    c = fields.extract("sglang", _json(fixture))
    assert (c.drafted, c.accepted, c.verify_forwards, c.gamma) == (30, 17, 10, 3)
    # histogram [2, 3, 1, 4]: position 0 accepted in 8 steps, 1 in 5, 2 in 4
    assert c.accepted_per_pos == [8, 5, 4]


def test_sglang_newest_names_win_over_aliases():
    meta = dict(_json("sglang_response_num_drafts.json")["meta_info"], spec_accepted_drafts=1, spec_proposed_drafts=2,
                spec_accept_histogram=[1, 1])
    c = fields.extract("sglang", {"meta_info": meta})
    assert (c.drafted, c.accepted, c.accepted_per_pos) == (30, 17, [8, 5, 4])


@pytest.mark.parametrize("case", _json("unknown_fields.json")["cases"])
@pytest.mark.parametrize("engine", fields.ENGINES)
def test_unknown_or_broken_fields_are_inconclusive(engine, case):
    assert fields.extract(engine, case) is None


def test_inconclusive_record_adds_no_acceptance_volume_and_neutral_speedup():
    route = Router(load_policy(DEFAULT), {"spec": "http://a", "plain": "http://b"}).route("def f(x):", temperature=0)
    obs = Observation("spec", True, wall_s=2.0, ttft_s=0.5, decode_s=1.5, gaps_s=[0.5, 0.5, 0.5], chunks=4)
    rec = to_record(route, obs, plain_tps=None)
    assert (rec.request_class, rec.method, rec.drafted, rec.accepted, rec.new_tokens) == ("code", "draft", 0, 0, 4)
    assert rec.plain_s_estimate == rec.wall_s == 2.0  # no baseline: speed-up exactly 1, never < 1
    assert rec.token_latencies_s == [0.5, 0.5, 0.5, 0.5]


def test_speedup_estimate_from_plain_pool_speed():
    speed = PoolSpeed(alpha=1.0, min_baseline=1)
    assert speed.tps("plain") is None
    speed.observe("plain", Observation("plain", False, wall_s=1.1, ttft_s=0.1, decode_s=1.0, chunks=11))
    assert speed.tps("plain") == pytest.approx(10.0)
    route = Router(load_policy(DEFAULT), {"spec": "http://a", "plain": "http://b"}).route("def f(x):", temperature=0)
    obs = Observation("spec", True, wall_s=0.6, ttft_s=0.1, decode_s=0.5, chunks=11,
                      counts=fields.SpecCounts(20, 10, [6, 4], 6))
    rec = to_record(route, obs, speed.tps("plain"))
    assert rec.plain_s_estimate == pytest.approx(0.1 + 10 / 10.0)  # ttft + (n-1)/plain tps
    assert rec.plain_s_estimate / rec.wall_s == pytest.approx(1.1 / 0.6)
    assert (rec.drafted, rec.accepted, rec.accepted_per_pos, rec.target_forwards) == (20, 10, [6, 4], 6)


def _live(policy, **changes):
    """A LivePolicy stand-in over fixed settings (the real one is exercised in the live tests)."""
    import dataclasses

    eff = effective_for(policy, 1, 0.0)
    eff = {k: dataclasses.replace(v, **changes.get(k, {})) for k, v in eff.items()}

    class Fixed:
        stable_revision = 1
        rollout = None

        def policy(self, rev):
            return policy

        def settings_for(self, name):
            return eff.get(name)

    return Fixed()


def test_router_pools_fallback_probe_temperature_off():
    policy = load_policy(DEFAULT)
    pools = {"spec": "http://a", "plain": "http://b"}
    r = Router(policy, pools, rng=random.Random(1))
    code = r.route("def f(x):", temperature=0)
    assert (code.request_class, code.pool, code.method, code.fallback_reason) == ("code", "spec", "draft", None)
    sampled = r.route("def f(x):", temperature=1.0)  # the default policy's first class: temperature decides
    assert (sampled.request_class, sampled.pool, sampled.method) == ("sampled", "spec", "draft")
    assert r.route("def f(x):").request_class == "sampled"  # an OpenAI request without temperature samples at 1.0
    assert r.route("def f(x):", temperature=0.3).request_class == "code"
    hot = r.route("def f(x):", temperature=1.5)  # `sampled` speculates up to 1.0: hotter decodes plainly
    assert (hot.request_class, hot.pool, hot.fallback_reason) == ("sampled", "plain", REASON_TEMPERATURE)
    assert r.route("x", labels={"task": "code"}, temperature=0).request_class == "code"
    fb = Router(policy, pools, live=_live(policy, code={"fallback_active": True, "probe_fraction": 0.0}))
    moved = fb.route("def f(x):", temperature=0)
    assert (moved.pool, moved.method, moved.fallback_reason, moved.enforced) == ("plain", "ar", REASON_FALLBACK, True)
    assert fb.route("hello", temperature=0).pool == "spec"  # other classes untouched
    probing = Router(policy, pools, live=_live(policy, code={"fallback_active": True, "probe_fraction": 0.5}),
                     rng=random.Random(3))
    picks = [probing.route("def f(x):", temperature=0) for _ in range(400)]
    probes = sum(p.probe for p in picks)
    assert all(p.pool == "spec" for p in picks if p.probe) and all(p.pool == "plain" for p in picks if not p.probe)
    assert 150 < probes < 250  # binomial(400, 0.5): outside this range has p < 1e-4
    off = Router(policy, pools, live=_live(policy, general={"method": "off"}))
    assert off.route("hello", temperature=0).fallback_reason == REASON_OFF
    assert off.route("hello", temperature=0).pool == "plain"


def test_single_pool_reports_but_cannot_enforce():
    policy = load_policy(DEFAULT)
    r = Router(policy, {"spec": "http://a"}, live=_live(policy, code={"fallback_active": True, "probe_fraction": 0}))
    assert r.single
    route = r.route("def f(x):", temperature=0)
    got = (route.pool, route.fallback_reason, route.enforced, route.method)
    assert got == ("spec", REASON_FALLBACK, False, "draft")
    assert r.failover_pool("spec") is None
    with pytest.raises(ValueError, match="plain"):
        Router(policy, {"spec": "http://a", "other": "http://b"})


def test_policy_upstreams_schema_errors_name_file_and_line(tmp_path):
    text = DEFAULT.read_text() + "\nupstreams:\n  spec: fast\n  plain: Slow Pool\n  failover: maybe\n"
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    line = len(DEFAULT.read_text().splitlines()) + 4
    assert f"{path}:{line}: upstreams.plain" in str(err.value)
    ok = tmp_path / "ok.yaml"
    ok.write_text(DEFAULT.read_text() + "\nupstreams: {spec: fast, plain: slow, failover: false}\n")
    u = load_policy(ok).upstreams
    assert (u.spec, u.plain, u.failover) == ("fast", "slow", False)


@pytest.mark.parametrize("engine, fixture, kept, dropped", [
    ("vllm", "vllm_metrics.txt", {"vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                                  "vllm:spec_decode_num_accepted_tokens",
                                  "vllm:spec_decode_num_accepted_tokens_per_pos"}, "vllm:num_requests_running"),
    ("sglang", "sglang_metrics.txt", {"sglang:spec_accept_length", "sglang:spec_accept_rate", "sglang:spec_num_steps",
                                      "sglang:spec_num_draft_tokens"}, "sglang:num_running_reqs"),
])
def test_engine_metrics_republished_with_pool_label(engine, fixture, kept, dropped):
    registry = CollectorRegistry()
    scraper = EngineScraper(engine, {"spec": "http://a", "plain": "http://b"}, registry=registry)
    text = (FIX / fixture).read_text()
    scraper._families["spec"] = scraper.parse("spec", text)
    scraper._families["plain"] = scraper.parse("plain", text)
    out = generate_latest(registry).decode()
    names = {f.name for f in text_string_to_metric_families(out)}
    assert kept <= names and dropped not in names
    samples = [s for f in text_string_to_metric_families(out) for s in f.samples]
    assert {s.labels["pool"] for s in samples} == {"spec", "plain"}
    if engine == "vllm":
        pos = {(s.labels["pool"], s.labels["position"]): s.value for s in samples if "per_pos" in s.name}
        assert pos[("plain", "2")] == 7.0
    with pytest.raises(ValueError):
        scraper.parse("spec", "vllm:spec_decode_num_drafts_total{engine=\"0\" 1 2 3 garbage\n")


def test_stream_watcher_times_content_events_and_bounds_its_buffer():
    from specops.sidecar.stream import StreamWatcher

    w = StreamWatcher("vllm", started=0.0)
    w.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\ndata: {"choi', 0.1)
    w.feed(b'ces":[{"delta":{"content":"a"}}]}\r\n\r\n', 0.3)
    w.feed(b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n: comment\n\ndata: not json\n\n', 0.5)
    final = dict(_json("vllm_response.json"), choices=[])
    w.feed(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n", 0.6)
    assert (w.chunks, w.first, w.last, w.gaps, w.malformed, w.done) == (2, 0.3, 0.5, [pytest.approx(0.2)], 1, True)
    assert w.usage == 53 and w.counts.drafted == 129
    w.feed(b"x" * (2 * 1024 * 1024), 0.7)  # no event boundary in 2 MiB: not SSE
    assert w.malformed == 2 and w.buffer == b""
