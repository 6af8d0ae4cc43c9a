"""``specops sidecar`` in front of two real ``specops serve`` pools (bundled models):
one speculative (the default policy), one plain (every class ``method: off``).
The main sidecar writes its own records (``--records on``: the pools use namespaces of
their own); a second one, with the defaults, shares the spec pool's namespace and must
leave the records to the engine (each request counted once).

Routing by class, a fallback moving a class to the plain pool within one reconcile
period, probes, the stream relayed event for event, per-class records in Redis,
engine counters with a ``pool`` label, and Redis stopped → last known settings.
Kept to one module-scoped set of processes (loading the models is the slow part).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.services import Service, free_port, redis_server_binary, start_service, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "examples" / "policies" / "default.yaml"
RECONCILE_S = 1.0
NS = "side"


def _start_redis(workdir: Path, port: int) -> Service:
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--dir", str(workdir)]
    return start_service("redis", argv, port, workdir)


def _spawn(name: str, argv: list[str], workdir: Path, port: int) -> Service:
    log = workdir / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "specops.cli", *argv], cwd=workdir,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Service(name, proc, port, workdir, log)


def _wait_ready(svc: Service, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    wait_for_port(svc.port, timeout_s, svc.proc)
    while time.monotonic() < deadline:
        assert svc.proc.poll() is None, svc.log()
        try:
            if httpx.get(f"{svc.url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"{svc.name} not ready after {timeout_s}s\n{svc.log()}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("stack")
    rport = free_port()
    box = {"redis": _start_redis(work, rport), "rport": rport, "dir": work}
    redis_url = f"redis://127.0.0.1:{rport}/0"
    plain_policy = work / "plain.yaml"
    plain_policy.write_text(DEFAULT.read_text().replace("method: draft", "method: \"off\"")
                            .replace("method: medusa", "method: \"off\""))
    side_policy = work / "side.yaml"
    side_policy.write_text(DEFAULT.read_text() + "\nupstreams: {spec: spec, plain: plain, failover: true}\n")
    started: list[Service] = []
    try:
        for name, policy in (("spec", DEFAULT), ("plain", plain_policy)):
            port = free_port()
            d = work / name
            d.mkdir()
            svc = _spawn(name, ["serve", "--port", str(port), "--redis", redis_url, "--namespace", f"pool-{name}",
                                "--policy", str(policy), "--max-batch", "2", "--kv-cache-mb", "16", "--threads", "1",
                                "--log-level", "warning"], d, port)
            started.append(svc)
            box[name] = svc
        for svc in started:
            _wait_ready(svc, 300)
        sport = free_port()
        side = _spawn("sidecar", ["sidecar", "--engine", "specops", "--upstream", f"spec={box['spec'].url}",
                                  "--upstream", f"plain={box['plain'].url}", "--policy", str(side_policy),
                                  "--redis", redis_url, "--namespace", NS, "--listen", f"127.0.0.1:{sport}",
                                  "--reconcile-s", str(RECONCILE_S), "--scrape-s", "0.5", "--read-timeout-s", "60",
                                  "--records", "on", "--log-level", "warning"], work, sport)
        started.append(side)
        box["side"] = side
        # a second sidecar with the defaults, sharing the spec pool's namespace (one namespace for all)
        shared_port = free_port()
        shared = _spawn("sidecar-shared", ["sidecar", "--engine", "specops", "--upstream", f"spec={box['spec'].url}",
                                           "--policy", str(DEFAULT), "--redis", redis_url, "--namespace", "pool-spec",
                                           "--listen", f"127.0.0.1:{shared_port}", "--log-level", "warning"],
                        work, shared_port)
        started.append(shared)
        box["shared"] = shared
        _wait_ready(side, 60)
        _wait_ready(shared, 60)
        yield box
    finally:
        for svc in reversed(started):
            svc.stop(timeout_s=20)
        box["redis"].stop()


def _store(box):
    import redis

    from specops.policies.store import PolicyStore

    return PolicyStore(redis.Redis(host="127.0.0.1", port=box["rport"]), namespace=NS)


def _post(box, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{box['side'].url}/v1/completions", json=body, headers=headers, timeout=120)


CODE = {"prompt": "def add(a, b):\n", "max_tokens": 6, "temperature": 0}


def _set_code(box, **changes) -> None:
    store = _store(box)
    code = store.effective()["code"]
    store.set_effective({"code": dataclasses.replace(code, **changes)}, epoch=None, reason="test")


def test_routing_by_class(stack):
    r = _post(stack, CODE)
    assert r.status_code == 200, r.text
    assert (r.headers["x-specops-class"], r.headers["x-specops-pool"]) == ("code", "spec")
    assert r.json()["specops"]["method"] == "draft"
    hot = _post(stack, dict(CODE, temperature=1.5))  # the `sampled` class speculates up to 1.0
    assert hot.headers["x-specops-class"] == "sampled"
    assert hot.headers["x-specops-pool"] == "plain" and hot.json()["specops"]["method"] == "ar"
    labelled = _post(stack, {"prompt": "x = 1", "max_tokens": 4, "temperature": 0, "metadata": {"task": "code"}})
    assert labelled.headers["x-specops-class"] == "code"


def test_stream_relayed_event_for_event(stack):
    body = dict(CODE, stream=True, stream_options={"include_usage": True})

    def events(url: str) -> list[dict]:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            raw = b"".join(r.iter_raw())
        out = []
        for ev in raw.split(b"\n\n"):
            if ev.startswith(b"data: ") and ev != b"data: [DONE]":
                e = json.loads(ev[6:])
                e.pop("id"), e.pop("created")  # differ per request by design
                out.append(e)
        assert raw.endswith(b"data: [DONE]\n\n")
        return out

    def shape(evs: list[dict]) -> tuple:
        """What does not depend on engine timing: the text, the keys of every event, the
        finish reason and usage. How many tokens one step commits (so how the text is
        chunked) and drafted/accepted depend on the load-aware planner's timing, which
        differs between two requests; event-for-event relaying of fixed upstream bytes is
        tested against a scripted upstream (test_faults.py::test_stream_bytes_pass_through_exactly)."""
        text = "".join(c["text"] for e in evs for c in e["choices"])
        keys = {tuple(sorted(e)) for e in evs}
        last = [e for e in evs if e["choices"]][-1]["choices"][0]["finish_reason"]
        usage = [e["usage"] for e in evs if e.get("usage")]
        return text, keys, last, usage

    direct = events(stack["spec"].url)
    through = events(stack["side"].url)
    assert shape(through) == shape(direct) and len(through) >= 3


def test_openai_client_through_the_sidecar(stack):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{stack['side'].url}/v1", api_key="none", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(model="bundled", messages=[{"role": "user", "content": "def f(x):"}],
                                                 max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [m.id for m in client.models.list().data] == ["bundled"]


def test_fallback_moves_the_class_within_one_reconcile_period_and_probes_keep_speculating(stack):
    try:
        _set_code(stack, fallback_active=True, probe_fraction=0.0)
        t0 = time.monotonic()
        while True:
            r = _post(stack, CODE)
            if r.headers["x-specops-pool"] == "plain":
                break
            assert time.monotonic() - t0 < RECONCILE_S + 2.0, "class not moved within one reconcile period"
            time.sleep(0.1)
        assert r.json()["specops"]["method"] == "ar"
        assert _post(stack, {"prompt": "hello there", "max_tokens": 3, "temperature": 0}).headers[
            "x-specops-pool"] == "spec"  # other classes stay
        _set_code(stack, probe_fraction=1.0)
        t0 = time.monotonic()
        while True:
            r = _post(stack, CODE)
            if r.headers.get("x-specops-probe") == "1":
                break
            assert time.monotonic() - t0 < RECONCILE_S + 2.0
            time.sleep(0.1)
        assert r.headers["x-specops-pool"] == "spec" and r.json()["specops"]["method"] == "draft"
    finally:
        _set_code(stack, fallback_active=False, probe_fraction=0.05)


def test_per_class_records_in_redis_and_metrics(stack):
    import redis

    from specops.telemetry.redis_metrics import RedisWindowReader

    for _ in range(2):
        assert _post(stack, CODE).status_code == 200
    reader = RedisWindowReader(redis.Redis(host="127.0.0.1", port=stack["rport"]), namespace=NS)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        w = reader.window("code", 300)
        if w.requests >= 4 and w.fallbacks.get("policy_fallback"):
            break
        time.sleep(0.2)
    assert w.requests >= 4 and w.new_tokens >= 4 * 1 and w.wall_s > 0
    assert w.fallbacks.get("policy_fallback", 0) >= 1  # the fallen-back request of the previous test
    assert "code" in reader.classes()
    text = httpx.get(f"{stack['side'].url}/metrics", timeout=10).text
    assert 'specops_requests_total{class="code",method="draft"}' in text
    assert 'specops_fallbacks_total{class="code",method="ar",reason="policy_fallback"}' in text
    assert 'pool="plain"' in text and 'pool="spec"' in text  # engine counters republished per pool
    assert "specops_engine_requests_total{" in text


def test_redis_down_routes_on_last_known_settings(stack):
    stack["redis"].stop()
    try:
        t0 = time.monotonic()
        r = _post(stack, CODE)
        assert r.status_code == 200 and r.headers["x-specops-pool"] == "spec"
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ready = httpx.get(f"{stack['side'].url}/readyz", timeout=5).json()
            if ready["policy"]["live"] is False:
                break
            time.sleep(0.2)
        assert ready["policy"]["stale_reason"] == "redis_unreachable" and ready["ready"] is True
        assert ready["policy"]["classes"]["code"]["method"] == "draft"
    finally:
        stack["redis"] = _start_redis(stack["dir"], stack["rport"])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if httpx.get(f"{stack['side'].url}/readyz", timeout=5).json()["policy"]["live"]:
            break
        time.sleep(0.3)
    else:
        pytest.fail("sidecar did not reload the policy after Redis came back")


def test_shared_namespace_counts_each_request_once(stack):
    """Defaults (``--records auto``) with a specops pool in the same namespace: only the engine records."""
    import redis

    from specops.telemetry.redis_metrics import RedisWindowReader

    ready = httpx.get(f"{stack['shared'].url}/readyz", timeout=5).json()
    assert ready["records_by"] == "engine"
    reader = RedisWindowReader(redis.Redis(host="127.0.0.1", port=stack["rport"]), namespace="pool-spec")
    time.sleep(1.5)  # earlier tests' records have been flushed
    before = reader.window("code", 300).requests
    n = 3
    for _ in range(n):
        r = httpx.post(f"{stack['shared'].url}/v1/completions", json=CODE, timeout=120)
        assert r.status_code == 200 and r.headers["x-specops-pool"] == "spec", r.text
    deadline = time.monotonic() + 10
    while reader.window("code", 300).requests < before + n and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)  # both writers have had their flush period: a second copy would have landed by now
    assert reader.window("code", 300).requests == before + n
