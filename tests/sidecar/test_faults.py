"""Bad upstreams behind a real ``specops sidecar`` process: malformed bodies, streams cut or
stalled, pools down (failover / 502), client mistakes (4xx) — every answer bounded in time.

The upstreams are small scripted HTTP servers on loopback (a thread each), whose
behaviour is picked by the prompt, so the byte stream they send is known exactly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.services import Service, free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "examples" / "policies" / "default.yaml"
READ_TIMEOUT_S = 1.0

# A stream with odd framing: an event split across writes, CRLF line ends, a comment line.
STREAM_PARTS = [
    b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"he',
    b'llo","finish_reason":null}]}\n\n',
    b': keep-alive comment\n\n',
    b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":" world","finish_reason":null}]}\r\n\r\n',
    b'data: {"id":"x","object":"text_completion","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":2,'
    b'"total_tokens":4},"specops":{"method":"draft","drafted":4,"accepted":3}}\n\n',
    b"data: [DONE]\n\n",
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/metrics":
            self._send(200, b"# TYPE specops_requests_total counter\n"
                       b'specops_requests_total{class="a",method="ar"} 1\n', "text/plain")
        else:
            self._send(200, json.dumps({"object": "list", "data": [{"id": self.server.name}]}).encode())

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length", "0")))
        body = json.loads(raw)
        prompt = body.get("prompt", "")
        self.server.seen.append((self.path, raw))
        if "MALFORMED" in prompt:
            self._send(200, b"<html>not json</html>", "text/html")
        elif "REJECT" in prompt:
            self._send(400, json.dumps({"error": {"message": "bad max_tokens", "type": "invalid_request_error",
                                                  "param": "max_tokens", "code": None}}).encode())
        elif "SLOW" in prompt:
            time.sleep(READ_TIMEOUT_S * 3)
            self._send(200, b"{}")
        elif body.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            parts = STREAM_PARTS
            if "CUT" in prompt:
                parts = STREAM_PARTS[:2]
            if "DRIP" in prompt:  # a long stream, to leave in the middle of
                try:
                    for _ in range(100):
                        part = STREAM_PARTS[3]
                        self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                        self.wfile.flush()
                        time.sleep(0.05)
                except OSError:
                    self.server.aborted += 1
                    self.close_connection = True
                return
            for part in parts:
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                self.wfile.flush()
                time.sleep(0.01)
                if "STALL" in prompt:
                    time.sleep(READ_TIMEOUT_S * 3)
                    return
            if "CUT" in prompt:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._send(200, json.dumps({"id": "c", "object": "text_completion", "pool": self.server.name,
                                        "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                                        "specops": {"method": "draft", "drafted": 2, "accepted": 1}}).encode())


def _fake(name: str) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.name = name
    srv.seen = []
    srv.aborted = 0
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _sidecar(tmp: Path, upstreams: dict[str, str], policy_extra: str = "") -> Service:
    policy = tmp / "policy.yaml"
    policy.write_text(DEFAULT.read_text() + policy_extra)
    port = free_port()
    argv = [sys.executable, "-m", "specops.cli", "sidecar", "--engine", "specops", "--policy", str(policy),
            "--listen", f"127.0.0.1:{port}", "--read-timeout-s", str(READ_TIMEOUT_S), "--connect-timeout-s", "0.5",
            "--request-timeout-s", "20", "--log-level", "warning"]
    for name, url in upstreams.items():
        argv += ["--upstream", f"{name}={url}"]
    log = tmp / f"sidecar-{port}.log"
    proc = subprocess.Popen(argv, cwd=tmp, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    svc = Service("sidecar", proc, port, tmp, log)
    try:
        wait_for_port(port, 60, proc)
    except Exception:
        svc.stop()
        raise RuntimeError(svc.log())
    return svc


@pytest.fixture(scope="module")
def pools():
    spec, plain = _fake("spec"), _fake("plain")
    yield spec, plain
    for s in (spec, plain):
        s.shutdown()
        s.server_close()


@pytest.fixture(scope="module")
def side(pools, tmp_path_factory):
    spec, plain = pools
    svc = _sidecar(tmp_path_factory.mktemp("side"), {"spec": f"http://127.0.0.1:{spec.server_port}",
                                                     "plain": f"http://127.0.0.1:{plain.server_port}"})
    yield svc
    svc.stop()


def _post(svc, body, **kw) -> httpx.Response:
    return httpx.post(f"{svc.url}/v1/completions", json=body, timeout=15, **kw)


def test_stream_bytes_pass_through_exactly(side):
    body = {"prompt": "def f(x):", "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{side.url}/v1/completions", json=body, timeout=15) as r:
        assert r.status_code == 200 and r.headers["x-specops-pool"] == "spec"
        assert r.headers["x-specops-class"] == "code"
        got = b"".join(r.iter_raw())
    assert got == b"".join(STREAM_PARTS)


def test_non_streaming_routed_and_body_unchanged(side, pools):
    r = _post(side, {"prompt": "tell me a story", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["pool"] == "spec" and r.headers["x-specops-class"] == "general"
    assert json.loads(pools[0].seen[-1][1]) == {"prompt": "tell me a story", "max_tokens": 3, "temperature": 0}
    # temperature above the class's range (`sampled`: up to 1.0) → plain pool
    r = _post(side, {"prompt": "def f(x):", "temperature": 1.7})
    assert r.json()["pool"] == "plain" and r.headers["x-specops-class"] == "sampled"


def test_malformed_upstream_body_is_a_clear_502(side):
    t0 = time.monotonic()
    r = _post(side, {"prompt": "MALFORMED", "temperature": 0})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_malformed" and "not JSON" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5


def test_engine_4xx_passes_through_unchanged(side):
    r = _post(side, {"prompt": "REJECT", "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("raw, status", [(b"{not json", 400), (b"[1, 2]", 400), (b"x" * (4 * 1024 * 1024 + 10), 413)])
def test_client_mistakes_are_4xx(side, raw, status):
    r = httpx.post(f"{side.url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=15)
    assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error"


def test_stream_cut_mid_way_ends_with_an_error_event(side):
    t0 = time.monotonic()
    with httpx.stream("POST", f"{side.url}/v1/completions", json={"prompt": "CUT", "stream": True}, timeout=15) as r:
        assert r.status_code == 200
        got = b"".join(r.iter_raw())
    assert got.startswith(b"".join(STREAM_PARTS[:2]))
    last = got.strip().split(b"\n\n")[-1]
    err = json.loads(last[len(b"data: "):])["error"]
    assert err["code"] == "upstream_truncated"
    assert time.monotonic() - t0 < 5


def test_stalled_stream_and_slow_answer_time_out(side):
    t0 = time.monotonic()
    with httpx.stream("POST", f"{side.url}/v1/completions", json={"prompt": "STALL", "stream": True}, timeout=15) as r:
        got = b"".join(r.iter_raw())
    assert json.loads(got.strip().split(b"\n\n")[-1][len(b"data: "):])["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - t0 < READ_TIMEOUT_S + 3
    t0 = time.monotonic()
    r = _post(side, {"prompt": "SLOW", "temperature": 0})
    # no failover after a timeout (the engine may still be running it): 504 after one read timeout
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - t0 < READ_TIMEOUT_S + 2


def test_pool_down_fails_over_then_502_without_failover(pools, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    plain = f"http://127.0.0.1:{pools[1].server_port}"
    svc = _sidecar(tmp_path, {"spec": dead, "plain": plain})
    try:
        r = _post(svc, {"prompt": "def f(x):", "temperature": 0})
        assert r.status_code == 200 and r.json()["pool"] == "plain" and r.headers["x-specops-pool"] == "plain"
        ready = httpx.get(f"{svc.url}/readyz", timeout=5).json()
        assert ready["pools"]["spec"]["up"] is False and ready["pools"]["plain"]["up"] is True and ready["ready"]
        metrics = httpx.get(f"{svc.url}/metrics", timeout=5).text
        assert 'specops_sidecar_failovers_total{from_pool="spec"} 1.0' in metrics
    finally:
        svc.stop()
    strict = tmp_path / "strict"
    strict.mkdir()
    svc = _sidecar(strict, {"spec": dead, "plain": plain}, "\nupstreams: {failover: false}\n")
    try:
        t0 = time.monotonic()
        r = _post(svc, {"prompt": "def f(x):", "temperature": 0})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
        assert time.monotonic() - t0 < 5
        single = httpx.get(f"{svc.url}/readyz", timeout=5).json()
        assert single["fallback_enforceable"] is True
    finally:
        svc.stop()


def test_no_connections_leak_after_failures(side):
    """After the failure tests, the sidecar still answers promptly and holds few sockets."""
    for _ in range(5):
        with httpx.stream("POST", f"{side.url}/v1/completions", json={"prompt": "CUT", "stream": True},
                          timeout=15) as r:
            b"".join(r.iter_raw())
    r = _post(side, {"prompt": "tell me", "temperature": 0})
    assert r.status_code == 200
    fds = len(os.listdir(f"/proc/{side.proc.pid}/fd"))
    assert fds < 60, f"sidecar holds {fds} file descriptors"


def test_client_leaving_mid_stream_closes_the_engine_connection(side, pools):
    with httpx.stream("POST", f"{side.url}/v1/completions", json={"prompt": "DRIP", "stream": True}, timeout=15) as r:
        assert r.status_code == 200
        next(r.iter_raw())
    t0 = time.monotonic()  # the engine would stream for 5 s more
    while pools[0].aborted == 0 and time.monotonic() - t0 < 4:
        time.sleep(0.05)
    assert pools[0].aborted == 1, "the engine kept streaming to nobody"
    metrics = httpx.get(f"{side.url}/metrics", timeout=5).text
    assert 'outcome="client_gone"' in metrics and 'pool="spec"' in metrics
