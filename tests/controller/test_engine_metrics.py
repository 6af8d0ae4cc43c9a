"""vLLM / SGLang metric adapters over real HTTP, and wired into ``specops controller run``.

A real HTTP server on a loopback port serves ``/metrics`` pages written in each engine's
documented exposition format (``tests/controller/fixtures``; the sources are cited in
each file), one page per scrape, so counters grow between scrapes as on a live pod.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from specops.cli import main
from specops.controller.engine_sources import SglangSource, VllmSource, engine_sources
from tests.controller.helpers import FakeClock
from tests.services import free_port

FIXTURES = Path(__file__).parent / "fixtures"


class EnginePod:
    """Serves ``/<engine>/metrics``: the engine's pages in order, then the last one again."""

    def __init__(self) -> None:
        self.pages = {engine: [(FIXTURES / f"{engine}_metrics_{i}.txt").read_bytes() for i in (0, 1)]
                      for engine in ("vllm", "sglang")}
        self.hits = {engine: 0 for engine in self.pages}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                engine = self.path.strip("/").split("/")[0]
                if engine not in outer.pages or not self.path.endswith("/metrics"):
                    self.send_error(404)
                    return
                pages = outer.pages[engine]
                body = pages[min(outer.hits[engine], len(pages) - 1)]
                outer.hits[engine] += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, engine: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{engine}/metrics"

    def __enter__(self) -> EnginePod:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_vllm_and_sglang_windows_over_http():
    clock = FakeClock()
    with EnginePod() as pod:
        vllm, sglang = engine_sources([f"vllm:code={pod.url('vllm')}", f"sglang={pod.url('sglang')}"], clock=clock)
        assert isinstance(vllm, VllmSource) and isinstance(sglang, SglangSource)
        first = vllm.read("code", 60)
        assert first.stats is None and first.error is None  # one scrape is no window yet: inconclusive
        assert vllm.read("chat", 60).stats is None and pod.hits["vllm"] == 1  # vllm is scoped to class code
        sglang.read("chat", 60)
        clock.advance(30)
        w = vllm.read("code", 60).stats
        s = sglang.read("chat", 60).stats  # an unscoped engine counts for every class
    assert pod.hits == {"vllm": 2, "sglang": 2}
    # vLLM V1 counters: deltas between the two scrapes
    assert (w.requests, w.drafted, w.accepted, w.target_forwards) == (500, 2000, 600, 500)
    assert w.accepted_per_pos == [300, 175, 90, 35] and w.acceptance_rate == pytest.approx(0.3)
    assert w.speedup is None  # engines report no plain-decoding baseline: speed rules stay inconclusive
    # SGLang gauges plus the generation-token counter: 3400 tokens at 3.4 per verify step
    assert (s.new_tokens, s.target_forwards, s.accepted, s.drafted) == (3400, 1000, 2400, 3000)
    assert s.acceptance_rate == pytest.approx(0.8)


@pytest.mark.parametrize("spec, needle", [
    ("tgi=http://pod/metrics", "ENGINE one of sglang, vllm"),
    ("vllm:code", "ENGINE=URL"),
    ("vllm=pod:8000/metrics", "http://"),
])
def test_bad_engine_specs_name_the_problem(spec, needle):
    with pytest.raises(ValueError, match=needle):
        engine_sources([spec])


POLICY = """
version: engines-1
default_class: code
classes:
  - name: code
  - name: chat
alerts:
  - {name: low-acceptance, metric: acceptance_rate, op: "<", threshold: 0.5, for_s: 0, min_samples: 100,
     action: fallback}
"""


def test_controller_run_reads_engine_metrics_and_falls_back(redis_client, redis_url, tmp_path):
    """vLLM pods of class code accept 30% of drafts, SGLang pods of chat 80%: the running
    controller scrapes both over HTTP and turns speculation off for code only.
    (``redis_client`` empties Redis first, so this policy is the one bootstrapped.)"""
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    with EnginePod() as pod:
        args = ["controller", "run", "--policy", str(policy), "--redis", redis_url, "--interval", "0.2",
                "--listen", f"127.0.0.1:{free_port()}", "--webhook-token", "t", "--run-for", "2.5",
                "--engine-metrics", f"vllm:code={pod.url('vllm')}",
                "--engine-metrics", f"sglang:chat={pod.url('sglang')}"]
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert pod.hits["vllm"] >= 2 and pod.hits["sglang"] >= 2
    effective = {cls: json.loads(redis_client.hget("{specops}:effective", cls)) for cls in ("code", "chat")}
    assert effective["code"]["fallback_active"] is True
    assert effective["chat"]["fallback_active"] is False


def test_controller_run_rejects_a_bad_engine_spec(redis_url):
    result = CliRunner().invoke(main, ["controller", "run", "--redis", redis_url, "--webhook-token", "t",
                                       "--run-for", "0", "--engine-metrics", "triton=http://x/metrics"])
    assert result.exit_code != 0 and "--engine-metrics" in result.output
