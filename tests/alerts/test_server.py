import json
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
