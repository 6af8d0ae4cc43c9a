"""``specops bench sidecar``: the summary arithmetic, and a real run against a scripted engine."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from specops.bench.sidecar_overhead import _sidecar_cpu, bench_sidecar_command, format_table, summarize


def _cell(ttft50, ttft99, itl, tpot, errors=0):
    return {"requests": 10, "errors": errors, "ttft_p50_ms": ttft50, "ttft_p99_ms": ttft99, "itl_p50_ms": itl,
            "tpot_p50_ms": tpot}


def test_summary_is_the_median_over_repeats_of_each_path_and_of_the_difference():
    runs = [{"repeat": 0, "concurrency": 1, "direct": _cell(10, 20, 5, 5), "sidecar": _cell(11, 22, 5.1, 5)},
            {"repeat": 1, "concurrency": 1, "direct": _cell(30, 40, 5, 5), "sidecar": _cell(31.5, 49, 5.2, 5)},
            {"repeat": 2, "concurrency": 1, "direct": _cell(12, 20, 5, 5), "sidecar": _cell(20, 21, 6.0, 5, errors=1)}]
    (row,) = summarize(runs)
    assert row["direct_ttft_p50_ms"] == 12 and row["sidecar_ttft_p50_ms"] == 20
    assert row["overhead_ttft_p50_ms"] == 1.5          # median of +1, +1.5, +8 (not 20 - 12)
    assert row["overhead_ttft_p99_ms"] == 2 and row["overhead_itl_p50_ms"] == pytest.approx(0.2)
    assert row["within_budget"] == {"ttft_p50": True, "ttft_p99": True, "chunk_p50": True}
    assert row["errors"] == 1 and row["repeats"] == 3
    assert (row["overhead_ttft_p50_ms_min"], row["overhead_ttft_p50_ms_max"]) == (1, 8)   # the spread beside it
    assert row["overhead_ttft_p50_ms_runs"] == [1, 1.5, 8]
    assert row["sidecar_cpu_ms_per_request"] is None  # runs without CPU readings
    runs[0]["sidecar"]["ttft_p50_ms"] = None  # a cell with no successful request
    assert summarize(runs)[0]["overhead_ttft_p50_ms"] == pytest.approx(4.75)


def test_sidecar_cpu_is_what_relaying_took_beyond_its_idle_rate():
    direct = {"_cpu_s": 0.02, "_wall_s": 10.0, "requests": 16, "_chunks": 500}   # idle: 2 ms/s
    via = {"_cpu_s": 0.52, "_wall_s": 10.0, "requests": 16, "_chunks": 500}
    cpu = _sidecar_cpu(direct, via)
    assert cpu["cpu_ms_per_request"] == pytest.approx(500 / 16) and cpu["cpu_ms_per_chunk"] == pytest.approx(1.0)
    assert cpu["cpu_idle_ms_per_s"] == pytest.approx(2.0)
    assert _sidecar_cpu(dict(direct, _cpu_s=None), via)["cpu_ms_per_request"] is None


class _Engine(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # small SSE writes go out at once, as an engine's do

    def log_message(self, *args):
        pass

    def _json(self, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        if self.path == "/readyz":
            self._json({"ready": True, "model": "scripted"})
        else:
            self._json({"object": "list", "data": []})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        n = body["max_tokens"]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(n)]
        events.append({"choices": [], "usage": {"completion_tokens": n},
                       "specops": {"method": "draft", "drafted": 2 * n, "accepted": n}})
        for ev in events:
            part = b"data: " + json.dumps(ev).encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
            time.sleep(0.002)
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def test_a_run_against_a_scripted_engine_measures_both_paths(tmp_path):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "overhead.json"
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("def add(a, b):\nhello there\n")
        result = CliRunner().invoke(bench_sidecar_command, [
            "--prompts", str(prompts),
            "--base-url", f"http://127.0.0.1:{srv.server_port}", "--concurrency", "1,4", "--repeats", "2",
            "--num-prompts", "6", "--max-tokens", "5", "--quiet", "--json", str(out)])
        assert result.exit_code == 0, result.output
        report = json.loads(out.read_text())
    finally:
        srv.shutdown()
        srv.server_close()
    assert [r["concurrency"] for r in report["results"]] == [1, 4]
    assert [(r["repeat"], r["concurrency"], r["first"]) for r in report["runs"]] == [
        (0, 1, "direct"), (0, 4, "direct"), (1, 1, "sidecar"), (1, 4, "sidecar")]  # order alternates
    for row in report["results"]:
        assert row["errors"] == 0
        assert row["direct_ttft_p50_ms"] > 0 and row["sidecar_ttft_p50_ms"] > 0
        diffs = [r["sidecar"]["ttft_p50_ms"] - r["direct"]["ttft_p50_ms"]
                 for r in report["runs"] if r["concurrency"] == row["concurrency"]]
        assert row["overhead_ttft_p50_ms"] == pytest.approx(sum(diffs) / 2)  # the median of two
    assert "overhead" in result.output and "direct" in result.output and "spread" in result.output
    for row in report["results"]:  # the sidecar's CPU was read (Linux) and is per request > per chunk > 0
        assert row["sidecar_cpu_ms_per_request"] > row["sidecar_cpu_ms_per_chunk"] > 0
        assert len(row["overhead_itl_p50_ms_runs"]) == 2
    assert "sidecar CPU" in format_table(report)
    plain = CliRunner().invoke(bench_sidecar_command, ["--plain", "--base-url", "http://127.0.0.1:1"])
    assert plain.exit_code != 0 and "off.yaml" in plain.output
    port = int(report["sidecar_url"].rsplit(":", 1)[1])
    with socket.socket() as s:  # the sidecar it started has been stopped
        assert s.connect_ex(("127.0.0.1", port)) != 0
