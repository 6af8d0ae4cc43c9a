import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specops.controller.engine_sources import SglangSource, VllmSource
from specops.controller.sources import CombinedSource, PrometheusSource, RedisWindowSource, window_query
from specops.telemetry.records import DecodeRecord
from specops.telemetry.redis_metrics import RedisPublisher, RedisWindowReader
from tests.controller.helpers import FakeClock
from tests.services import free_port


def _sample(field, value, **labels):
    return {"metric": {"class": "code", "specops_field": field, **labels}, "value": [1700000000, str(value)]}


PROM_RESULT = [
    _sample("requests", 12), _sample("new_tokens", 900.0), _sample("drafted", 800), _sample("accepted", 600.4),
    _sample("accepted_per_pos", 250, position="0"), _sample("accepted_per_pos", 200, position="1"),
    _sample("accepted_per_pos", 150.2, position="2"), _sample("target_forwards", 300), _sample("draft_s", 0.8),
    _sample("verify_s", 6.0), _sample("wall_s", 7.0), _sample("plain_s_estimate", 18.0),
    _sample("p99_token_latency_s", 0.05), _sample("head_predictions", 10, head="0"), _sample("head_correct", 7, head="0"),
]


class _FakeProm:
    """An HTTP server answering /api/v1/query like Prometheus, recording the queries."""

    def __init__(self, status=200, body=None):
        self.queries = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urlsplit(self.path)
                outer.queries.append(parse_qs(url.query)["query"][0])
                payload = body if body is not None else {"status": "success",
                                                         "data": {"resultType": "vector", "result": PROM_RESULT}}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_prometheus_source_one_query_per_window():
    prom = _FakeProm()
    with prom as url:
        src = PrometheusSource(url, timeout_s=2)
        reading = src.read("code", 60)
        assert prom.queries == [window_query("code", 60)]  # the whole window in one instant query
        src.read("code", 300)
        src.read("chat", 60)
    assert prom.queries == [window_query("code", 60), window_query("code", 300), window_query("chat", 60)]
    stats = reading.stats
    assert reading.error is None
    assert (stats.requests, stats.drafted, stats.accepted, stats.target_forwards) == (12, 800, 600, 300)
    assert stats.accepted_per_pos == [250, 200, 150]
    assert stats.speedup == pytest.approx(18.0 / 7.0)
    assert stats.acceptance_rate == pytest.approx(0.75)
    assert stats.p99_token_latency_s == pytest.approx(0.05)
    assert stats.head_accuracy == [pytest.approx(0.7)]


def test_window_query_uses_contract_names_and_class_matcher():
    q = window_query('we"ird', 90)
    assert 'class="we\\"ird"' in q and "[90s]" in q
    assert "specops_drafted_tokens_total" in q and "specops_accepted_tokens_by_position_total" in q
    assert "histogram_quantile(0.99" in q


def test_prometheus_errors_are_inconclusive():
    with _FakeProm(status=400, body={"status": "error", "error": "parse error"}) as url:
        reading = PrometheusSource(url).read("code", 60)
    assert reading.stats is None and "parse error" in reading.error
    reading = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout_s=1).read("code", 60)
    assert reading.stats is None and reading.error
    with _FakeProm(body={"status": "success", "data": {"resultType": "vector", "result": []}}) as url:
        reading = PrometheusSource(url).read("code", 60)
    assert reading.stats is None and reading.error is None  # empty: inconclusive, not an error
    with pytest.raises(ValueError):
        PrometheusSource("localhost:9090")


def _record(cls="code"):
    return DecodeRecord(cls, "draft", 8, 8, 6, [3, 2, 1], 2, 0.01, 0.05, 0.06, 0.16, [], [], [], 4, 0)


def test_redis_source_reads_all_classes_and_reports_outage(redis_client):
    clock = FakeClock()
    pubs = [RedisPublisher(redis_client, f"pod-{i}", clock=clock) for i in range(3)]
    for p in pubs:
        p.publish(_record())
    src = RedisWindowSource(RedisWindowReader(redis_client, clock=clock))
    out = src.read_many(["code", "chat"], 30)
    assert out["code"].stats.requests == 3 and out["code"].stats.accepted == 18
    assert out["chat"].stats is None and out["chat"].error is None
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    reading = RedisWindowSource(RedisWindowReader(dead, clock=clock)).read("code", 30)
    assert reading.stats is None and reading.error
    combined = CombinedSource([RedisWindowSource(RedisWindowReader(dead, clock=clock)), src])
    assert combined.read("code", 30).stats.requests == 3
    # empty in one source, the other unreachable: unknown (an error), not "no traffic"
    empty_then_dead = CombinedSource([src, RedisWindowSource(RedisWindowReader(dead, clock=clock), name="down")])
    assert empty_then_dead.read("chat", 30).stats is None and "down: redis" in empty_then_dead.read("chat", 30).error
    assert CombinedSource([src, src]).read("chat", 30).error is None


def test_window_query_extra_matchers_select_the_canary_series():
    q = window_query("code", 60, 'track="canary"')
    assert q.count('{class="code", track="canary"}') == q.count("{class=") > 5
    for bad in ("", "track", "track=canary", 'a="x"}or{', 'a="x" b="y"'):
        with pytest.raises(ValueError, match="label matchers"):
            window_query("code", 60, bad) if bad else PrometheusSource("http://127.0.0.1:1", match=" ")
    assert PrometheusSource("http://127.0.0.1:1", match='a="x,y", b!~"q\\"r"').match == 'a="x,y", b!~"q\\"r"'


VLLM_V1 = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {draft_tokens}
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} {p1}
"""


def test_vllm_v1_counter_deltas():
    clock = FakeClock()
    pages = iter([VLLM_V1.format(drafts=100, draft_tokens=200, accepted=150, p0=90, p1=60),
                  VLLM_V1.format(drafts=300, draft_tokens=600, accepted=350, p0=210, p1=140)])
    src = VllmSource({"code": ["http://pod-a/metrics"]}, fetch=lambda url: next(pages), clock=clock)
    assert src.window("code", 60) is None  # one scrape is no window
    clock.advance(10)
    w = src.window("code", 60)
    assert (w.requests, w.drafted, w.accepted) == (200, 400, 200)
    assert w.accepted_per_pos == [120, 80]
    assert w.acceptance_rate == pytest.approx(0.5)
    assert w.speedup is None and w.tokens_per_s is None  # vLLM reports no plain-decoding baseline
    assert w.mean_accepted_len == pytest.approx(2.0)


def test_vllm_v0_gauges_and_bad_text():
    text = ("# TYPE vllm:spec_decode_draft_acceptance_rate gauge\nvllm:spec_decode_draft_acceptance_rate 0.42\n"
            "# TYPE vllm:spec_decode_efficiency gauge\nvllm:spec_decode_efficiency 0.3\n")
    src = VllmSource({"chat": ["u"]}, fetch=lambda url: text, clock=FakeClock())
    src.scrape("chat")
    w = src.window("chat", 60)
    assert w.acceptance_rate == pytest.approx(0.42) and w.drafted == 0
    broken = VllmSource({"chat": ["u"]}, fetch=lambda url: "this is {not exposition", clock=FakeClock())
    reading = broken.read("chat", 60)
    assert reading.stats is None and "exposition" in reading.error


def test_sglang_gauges():
    def page(tokens):
        return ("# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length 3.0\n"
                "# TYPE sglang:spec_accept_rate gauge\nsglang:spec_accept_rate 0.5\n"
                f"# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total {tokens}\n")
    pages = iter([page(1000), page(1600)])
    clock = FakeClock()
    src = SglangSource({"code": ["u"]}, fetch=lambda url: next(pages), clock=clock)
    src.scrape("code")
    clock.advance(10)
    w = src.window("code", 60)
    assert w.mean_accepted_len == pytest.approx(3.0) and w.acceptance_rate == pytest.approx(0.5)
    assert w.new_tokens == 600 and w.target_forwards == 200 and w.accepted == 400 and w.drafted == 800
    assert w.speedup is None
