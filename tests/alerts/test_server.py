import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from specops.alerts.server import ControlServer
from specops.alerts.webhook import WebhookReceiver
from tests.alerts.payloads import alert, alertmanager, grafana

TOKEN = "tok"


def _request(url, body=None, token=TOKEN, method=None):
    req = urllib.request.Request(url, data=body, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def served():
    received = []
    registry = CollectorRegistry()
    Counter("specops_controller_ticks", "ticks", registry=registry).inc(3)
    health = {"problem": None}
    server = ControlServer(WebhookReceiver(TOKEN, received.append), registry, port=0, health=lambda: health["problem"])
    server.start()
    yield server, received, health
    server.stop()


def test_metrics_and_healthz(served):
    server, _, health = served
    status, body = _request(server.url + "/metrics", token=None)
    assert status == 200 and "specops_controller_ticks_total 3.0" in body
    assert _request(server.url + "/healthz", token=None) == (200, "ok\n")
    health["problem"] = "not leader"
    status, body = _request(server.url + "/healthz", token=None)
    assert status == 503 and "not leader" in body
    assert _request(server.url + "/nope", token=None)[0] == 404


def test_openapi_document_lists_every_route_and_its_security(served):
    server, _, _ = served
    status, body = _request(server.url + "/openapi.json", token=None)
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {"/metrics", "/healthz", "/openapi.json", "/webhook/alertmanager", "/webhook/grafana"}
    secured = {path for path, ops in doc["paths"].items() for op in ops.values() if op.get("security")}
    assert secured == {"/webhook/alertmanager", "/webhook/grafana"}
    for path in secured:  # every secured route in the document answers 401 without the token
        assert _request(server.url + path, b"{}", token=None)[0] == 401


@pytest.mark.parametrize("method,path,allow", [("PUT", "/webhook/alertmanager", "POST"),
                                               ("DELETE", "/metrics", "GET"), ("PATCH", "/healthz", "GET"),
                                               ("POST", "/metrics", "GET"), ("GET", "/webhook/grafana", "POST"),
                                               ("HEAD", "/openapi.json", "GET"), ("OPTIONS", "/webhook/x", "POST")])
def test_a_wrong_method_is_405_never_501(served, method, path, allow):
    server, received, _ = served
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(method, path, body=b'{"version": "4", "alerts": []}' if method != "HEAD" else None)
        resp = conn.getresponse()
        resp.read()
        assert (resp.status, resp.getheader("Allow")) == (405, allow)
    finally:
        conn.close()
    assert _request(server.url + "/nope", b"{}", method="PUT")[0] == 404 and not received


def test_webhooks_over_http(served):
    server, received, _ = served
    status, body = _request(server.url + "/webhook/alertmanager", alertmanager(alert(cls="code", fingerprint="1")))
    assert status == 200 and json.loads(body) == {"actions": 1, "duplicates": 0, "ignored": 0}
    status, body = _request(server.url + "/webhook/grafana", grafana(alert(cls="code", fingerprint="1")))
    assert status == 200 and json.loads(body)["duplicates"] == 1
    assert [(a.kind, a.request_class) for a in received] == [("fallback", "code")]
    assert _request(server.url + "/webhook/alertmanager", alertmanager(alert()), token="bad")[0] == 401
    assert _request(server.url + "/webhook/alertmanager", alertmanager(alert()), token=None)[0] == 401
    assert _request(server.url + "/webhook/alertmanager", b"{", token=TOKEN)[0] == 400
    assert _request(server.url + "/webhook/other", alertmanager(alert()))[0] == 404
    assert len(received) == 1


def test_unknown_action_label_answers_422_naming_it(served):
    server, received, _ = served
    status, body = _request(server.url + "/webhook/alertmanager",
                            alertmanager(alert(action="explode", fingerprint="1"), alert(cls="code", fingerprint="2")))
    answer = json.loads(body)
    assert status == 422 and "action='explode'" in answer["error"] and len(answer["rejected"]) == 1
    assert answer["actions"] == 1 and [a.fingerprint for a in received] == ["2"]


def test_callback_error_answers_500_so_the_sender_retries():
    def broken(action):
        raise RuntimeError("boom")

    with ControlServer(WebhookReceiver(TOKEN, broken)) as server:
        status, body = _request(server.url + "/webhook/alertmanager", alertmanager(alert()))
    assert status == 500 and "retry" in body


def test_start_stop_frees_the_port():
    server = ControlServer(WebhookReceiver(TOKEN, lambda a: None)).start()
    port = server.port
    server.stop()
    again = ControlServer(WebhookReceiver(TOKEN, lambda a: None), port=port).start()
    try:
        assert again.port == port and _request(again.url + "/healthz", token=None)[0] == 200
    finally:
        again.stop()
    with pytest.raises(RuntimeError):
        _ = server.port


def _raw(server, data: bytes, *, read_timeout_s: float = 10.0) -> bytes:
    """Send raw bytes on one connection; what comes back until the server closes it (or the timeout)."""
    import socket

    with socket.create_connection((server.host, server.port), timeout=read_timeout_s) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except TimeoutError:
            pass
    return b"".join(chunks)


def test_auth_is_checked_before_the_body_is_read(served):
    server, received, _ = served
    # announces 900 kB and sends none of it: refused at once, connection closed, no thread left waiting
    head = (b"POST /webhook/alertmanager HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
            b"Content-Type: application/json\r\nContent-Length: 900000\r\n\r\n")
    started = time.monotonic()
    answer = _raw(server, head, read_timeout_s=5)
    assert answer.startswith(b"HTTP/1.1 401") and time.monotonic() - started < 4 and received == []


def test_silent_client_is_timed_out():
    received = []
    with ControlServer(WebhookReceiver(TOKEN, received.append), read_timeout_s=0.5) as server:
        head = (b"POST /webhook/alertmanager HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n"
                b"Content-Length: 500\r\n\r\n{\"versi")  # then silence
        started = time.monotonic()
        answer = _raw(server, head, read_timeout_s=8)
        assert time.monotonic() - started < 5 and received == []  # the server hung up on its own
        assert answer.startswith(b"HTTP/1.1 408")


def test_chunked_body_is_accepted(served):
    server, received, _ = served
    body = alertmanager(alert(cls="code", fingerprint="chunky"))
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 100]), body[i:i + 100]) for i in range(0, len(body), 100))
    request = (b"POST /webhook/alertmanager HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n"
               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\n\r\n")
    answer = _raw(server, request)
    assert answer.startswith(b"HTTP/1.1 200") and [a.fingerprint for a in received] == ["chunky"]
    bad = (b"POST /webhook/alertmanager HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n"
           b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
    assert _raw(server, bad).startswith(b"HTTP/1.1 400")


def test_token_from_a_secret_file_with_trailing_newline(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("file-token\n")
    received = []
    server = ControlServer(WebhookReceiver(secret.read_text(), received.append)).start()
    try:
        status, _ = _request(f"{server.url}/webhook/alertmanager", alertmanager(alert()), token="file-token")
        assert status == 200 and len(received) == 1
    finally:
        server.stop()


def test_refused_calls_on_one_keep_alive_connection_all_get_their_401(served):
    """A 401 sent without reading the body closes the connection and says so (Connection: close);
    a keep-alive client then reconnects instead of finding the connection dropped (found by
    `specops chaos`: the second call on a reused connection got no answer at all)."""
    import httpx

    server, received, _ = served
    with httpx.Client(timeout=10) as client:
        answers = [client.post(server.url + "/webhook/alertmanager", content=alertmanager(alert()),
                               headers={"Authorization": f"Bearer wrong{i}"}) for i in range(5)]
        ok = client.post(server.url + "/webhook/alertmanager", content=alertmanager(alert(cls="code", fingerprint="k")),
                         headers={"Authorization": f"Bearer {TOKEN}"})
    assert [a.status_code for a in answers] == [401] * 5
    assert all(a.headers.get("connection") == "close" for a in answers)
    assert ok.status_code == 200 and len(received) == 1
