import json
import threading
import time
import urllib.request

import redis as redis_lib
from click.testing import CliRunner

from specops.cli import main
from tests.services import free_port

POLICY = """
version: run-1
default_class: code
classes:
  - name: code
alerts:
  - {name: slower, metric: speedup, op: "<", threshold: 1.0, for_s: 0, min_samples: 10, action: fallback}
"""


def test_controller_run_serves_metrics_and_applies_webhook_fallback(redis_client, redis_url, tmp_path):
    # redis_client empties Redis first: with a current revision left by another test the
    # controller would not bootstrap this policy
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    port = free_port()
    args = ["controller", "run", "--policy", str(policy), "--redis", redis_url, "--interval", "0.2",
            "--listen", f"127.0.0.1:{port}", "--webhook-token", "s3cret", "--run-for", "4"]
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", CliRunner().invoke(main, args)))
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 3
    metrics = ""
    while time.monotonic() < deadline and "specops_controller_tick_seconds_count" not in metrics:
        try:
            metrics = urllib.request.urlopen(f"{base}/metrics", timeout=1).read().decode()
        except OSError:
            time.sleep(0.1)
    assert "specops_controller_tick_seconds_count" in metrics
    payload = {"version": "4", "status": "firing", "alerts": [
        {"status": "firing", "labels": {"alertname": "slower", "class": "code", "rule": "slower", "action": "fallback"},
         "fingerprint": "abc"}]}
    req = urllib.request.Request(f"{base}/webhook/alertmanager", data=json.dumps(payload).encode(), method="POST",
                                 headers={"Authorization": "Bearer s3cret", "Content-Type": "application/json"})
    assert urllib.request.urlopen(req, timeout=2).status == 200
    thread.join(10)
    r = result["r"]
    assert r.exit_code == 0, r.output
    client = redis_lib.Redis.from_url(redis_url)
    eff = json.loads(client.hget("{specops}:effective", "code"))
    assert eff["fallback_active"] is True


def test_controller_run_requires_token(redis_url):
    r = CliRunner().invoke(main, ["controller", "run", "--redis", redis_url, "--run-for", "0"], env={"SPECOPS_WEBHOOK_TOKEN": ""})
    assert r.exit_code != 0 and "token" in r.output


def test_canary_match_needs_prometheus_and_well_formed_matchers(redis_url):
    base = ["controller", "run", "--redis", redis_url, "--run-for", "0", "--webhook-token", "t"]
    r = CliRunner().invoke(main, [*base, "--canary-match", 'track="canary"'])
    assert r.exit_code == 2 and "--prometheus" in r.output
    r = CliRunner().invoke(main, [*base, "--prometheus", "http://127.0.0.1:1", "--canary-match", "track=canary"])
    assert r.exit_code == 2 and "--canary-match" in r.output and "label matchers" in r.output
    r = CliRunner().invoke(main, [*base, "--prometheus", "http://127.0.0.1:1", "--canary-match", 'track="canary"'])
    assert r.exit_code == 0, r.output
