"""The whole alert path with real services, end to end.

test exporter (contract metrics; class ``creative`` decodes slower than plain)
  → real Prometheus (1 s scrapes) loaded with the rules `specops alerts render` produced
  → real Alertmanager (clustering off, group_wait 1 s), bearer token
  → the controller's webhook server → `Controller.apply_alert`
  → the class's effective settings in a real Redis fall back (speculation off).

Also: the controller's Prometheus source reads the same Prometheus through the
contract's PromQL. Every wait is bounded.
"""

from __future__ import annotations

import threading
import time

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

from specops.alerts.render import RenderOptions, render
from specops.alerts.server import ControlServer
from specops.alerts.webhook import WebhookReceiver
from specops.policies import load_policy
from specops.telemetry.exporter import PrometheusExporter
from tests.alerts.policies import e2e_policy
from tests.services import free_port, require_binary, start_service
from tests.telemetry.helpers import make_record

pytestmark = pytest.mark.services

TOKEN = "e2e-webhook-token"
DEADLINE_S = 60.0


class TrafficExporter:
    """Serves contract metrics; every 100 ms one request per class finishes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.exporter = PrometheusExporter(self.registry)
        self.port = free_port()
        self._stop = threading.Event()
        self._httpd, _ = start_http_server(self.port, addr="127.0.0.1", registry=self.registry)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        end = time.monotonic() + 2 * DEADLINE_S
        while not self._stop.is_set() and time.monotonic() < end:
            # chat: 1.5x faster than plain decoding; creative: half as fast (speed-up 0.5)
            self.exporter.observe(make_record("chat"))
            self.exporter.observe(make_record("creative", drafted=16, accepted=2, accepted_per_pos=[2, 0, 0, 0],
                                              wall_s=1.2, plain_s_estimate=0.6))
            self._stop.wait(0.1)

    def start(self) -> TrafficExporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._httpd.shutdown()
        self._httpd.server_close()


class NoData:
    """A metric source with no traffic: the controller's own ticks stay inconclusive."""

    name = "none"

    def read(self, request_class, seconds):
        from specops.controller.sources import Reading

        return Reading(None)

    def window(self, request_class, seconds):
        return None


def _wait(predicate, what: str, services=(), timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    logs = "\n".join(f"--- {s.name}\n{s.log()}" for s in services)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{logs}")


@pytest.fixture(scope="module")
def alert_stack(tmp_path_factory, redis_service):
    """One stack shared by this module's tests (starting it is most of their time)."""
    import redis

    tmp_path = tmp_path_factory.mktemp("alert-path")
    redis_client = redis.Redis(host="127.0.0.1", port=redis_service.port)
    redis_client.flushall()
    prometheus = require_binary("prometheus")
    alertmanager = require_binary("prometheus-alertmanager", "alertmanager")
    from specops.controller.controller import Controller
    from specops.policies.store import PolicyStore

    policy = load_policy(e2e_policy(for_s=2))
    store = PolicyStore(redis_client)
    controller = Controller(store, NoData(), policy_provider=lambda: policy)
    controller.tick()  # seeds every class's effective settings from the policy
    received = []

    def on_alert(action):
        received.append(action)
        controller.apply_alert(action)

    started = []
    try:
        webhook = ControlServer(WebhookReceiver(TOKEN, on_alert)).start()
        started.append(webhook)
        traffic = TrafficExporter().start()
        started.append(traffic)

        am_port = free_port()
        am_dir = tmp_path / "alertmanager"
        am_dir.mkdir()
        (am_dir / "alertmanager.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "specops", "group_by": ["alertname", "class"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "specops", "webhook_configs": [{
                "url": f"{webhook.url}/webhook/alertmanager", "send_resolved": True,
                "http_config": {"authorization": {"type": "Bearer", "credentials": TOKEN}}}]}],
        }))
        am = start_service("alertmanager", [
            alertmanager, f"--config.file={am_dir / 'alertmanager.yml'}", f"--storage.path={am_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address=",
        ], am_port, am_dir)
        started.append(am)

        prom_port = free_port()
        prom_dir = tmp_path / "prometheus"
        prom_dir.mkdir()
        (prom_dir / "rules.yml").write_text(render(policy, "prometheus", RenderOptions(window="10s", interval="1s")))
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(prom_dir / "rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "specops", "static_configs": [{"targets": [f"127.0.0.1:{traffic.port}"]}]}],
        }))
        prom = start_service("prometheus", [
            prometheus, f"--config.file={prom_dir / 'prometheus.yml'}", f"--storage.tsdb.path={prom_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ], prom_port, prom_dir)
        started.append(prom)
        yield {"store": store, "received": received, "prometheus": prom, "alertmanager": am}
    finally:
        for svc in reversed(started):
            svc.stop()
        redis_client.close()


def test_speedup_below_one_falls_the_class_back_through_prometheus_and_alertmanager(alert_stack):
    store, received = alert_stack["store"], alert_stack["received"]
    services = (alert_stack["prometheus"], alert_stack["alertmanager"])
    before = store.effective()
    assert not before["creative"].fallback_active and not before["chat"].fallback_active

    action = _wait(lambda: next((a for a in received if a.request_class == "creative"), None),
                   "the fallback alert for class creative at the webhook", services)
    assert (action.kind, action.rule) == ("fallback", "speedup-below-1") and action.fingerprint

    after = store.effective()
    assert after["creative"].fallback_active is True       # speculation off for the slow class
    assert after["chat"].fallback_active is False          # the healthy class is untouched
    assert {a.request_class for a in received} == {"creative"}
    audit = store.read_audit(50)
    assert any("speedup-below-1" in str(event) for event in audit)


def test_controller_prometheus_source_reads_the_contract_series(alert_stack):
    from specops.controller.sources import PrometheusSource

    source = PrometheusSource(alert_stack["prometheus"].url)
    services = (alert_stack["prometheus"],)
    creative = _wait(lambda: (w := source.window("creative", 10)) is not None and w.drafted > 0 and w.wall_s > 0 and w,
                     "a creative window from Prometheus", services)
    chat = _wait(lambda: (w := source.window("chat", 10)) is not None and w.drafted > 0 and w.wall_s > 0 and w,
                 "a chat window from Prometheus", services)
    assert creative.speedup == pytest.approx(0.5, rel=0.05)
    assert creative.acceptance_rate == pytest.approx(2 / 16, rel=0.05)
    assert chat.speedup == pytest.approx(1.5, rel=0.05)
    assert chat.acceptance_rate == pytest.approx(12 / 16, rel=0.05)
    assert source.window("no-such-class", 10) is None   # no traffic: inconclusive, not a failure
