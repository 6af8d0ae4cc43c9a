"""A live ``specops serve`` subprocess on the bundled models, driven over HTTP.

The official ``openai`` client (streaming and not), raw SSE framing, the 400 / 401 /
404 / 429 paths, client disconnects, a policy change applied while serving, the
``/health`` alias of ``/healthz``, and the fail-static path: Redis emptied (FLUSHALL) and Redis stopped and
restarted mid-load with no failed request and no lost telemetry record.

One server for the module (loading and calibrating takes a while on a small CPU),
against its own Redis (the tests stop and restart it), on free loopback ports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.services import Service, free_port, redis_server_binary, start_service, wait_for_port

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-123"
NS = "srv"
RECONCILE_S = 1.0
POLICY_CHANGE_S = 10 * RECONCILE_S  # how long a policy change may take to show on a loaded machine
AUTH = {"Authorization": f"Bearer {KEY}"}


def _start_redis(workdir: Path, port: int) -> Service:
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--dir", str(workdir)]
    return start_service("redis", argv, port, workdir)


@pytest.fixture(scope="module")
def redis_box(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("srv-redis")
    port = free_port()
    box = {"svc": _start_redis(workdir, port), "port": port, "dir": workdir}
    yield box
    box["svc"].stop()


@pytest.fixture(scope="module")
def server(redis_box, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("srv")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECOPS_TEST_KEY=KEY)
    argv = [sys.executable, "-m", "specops.cli", "serve", "--port", str(port),
            "--redis", f"redis://127.0.0.1:{redis_box['port']}/0", "--namespace", NS, "--max-batch", "2",
            "--max-queue", "2", "--kv-cache-mb", "16", "--reconcile-s", str(RECONCILE_S), "--threads", "1",
            "--api-key-env", "SPECOPS_TEST_KEY", "--log-level", "warning"]
    log_path = workdir / "serve.log"
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    svc = Service("serve", proc, port, workdir, log_path)
    try:
        wait_for_port(port, 120, proc)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, svc.log()
            r = httpx.get(f"{svc.url}/readyz", timeout=5)
            if r.status_code == 200:
                break
            assert r.json()["ready"] is False
            time.sleep(0.5)
        else:
            pytest.fail("server not ready after 300 s\n" + svc.log())
        yield svc
    finally:
        svc.stop(timeout_s=20)


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _ready(server) -> dict:
    return httpx.get(f"{server.url}/readyz", timeout=10).json()


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


def _store(redis_box):
    import redis

    from specops.policies.store import PolicyStore

    return PolicyStore(redis.Redis(host="127.0.0.1", port=redis_box["port"]), namespace=NS)


# -- the openai client -------------------------------------------------------------------
def test_openai_client_completion_and_chat(oai, server):
    models = oai.models.list()
    assert [m.id for m in models.data] == ["bundled"]
    out = oai.completions.create(model="bundled", prompt="def add(a, b):\n", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens <= 12 and out.usage.prompt_tokens > 0
    assert out.model_extra["specops"]["request_class"] == "code"
    again = oai.completions.create(model="bundled", prompt="def add(a, b):\n", max_tokens=12, temperature=0)
    assert again.choices[0].text == out.choices[0].text  # greedy is deterministic
    chat = oai.chat.completions.create(model="bundled", messages=[{"role": "user", "content": "Which module parses "
                                       "options?"}], max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 8
    assert chat.model_extra["specops"]["request_class"] == "factual"
    assert chat.model_extra["specops"]["typical"] is False  # lossy typical acceptance is a class's opt-in
    engine = _ready(server)["engine"]  # Medusa's prompt-lookup branches, counted since start
    assert engine["medusa_branch_tokens"] >= 0 and engine["medusa_branches"] >= 0


def test_openai_client_streaming_matches_non_streaming(oai):
    full = oai.completions.create(model="bundled", prompt="import os\n", max_tokens=16, temperature=0)
    chunks = list(oai.completions.create(model="bundled", prompt="import os\n", max_tokens=16, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == full.choices[0].finish_reason
    chat = list(oai.chat.completions.create(model="bundled", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("length", "stop")


def test_sse_framing_done_and_usage_chunk(server):
    body = {"model": "bundled", "prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "repetition_penalty": 1.0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(p["usage"] is None for p in payloads[:-1])
    usage = payloads[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["specops"]["method"] in ("ar", "draft", "ngram", "medusa")
    finals = [p for p in payloads[:-1] if p["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and payloads[-2] is finals[0]


def test_stop_string_truncates(oai):
    full = oai.completions.create(model="bundled", prompt="import os\nimport sys\n", max_tokens=24, temperature=0)
    text = full.choices[0].text
    cut = next((i for i in range(2, len(text)) if text[i] not in " \n"), None)
    assert cut is not None, text
    stop = text[cut:cut + 2]
    first = text.find(stop)
    short = oai.completions.create(model="bundled", prompt="import os\nimport sys\n", max_tokens=24, temperature=0,
                                   stop=[stop])
    assert short.choices[0].finish_reason == "stop" and short.choices[0].text == text[:first]
    streamed = oai.completions.create(model="bundled", prompt="import os\nimport sys\n", max_tokens=24,
                                      temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[:first]


def test_request_class_from_labels_headers_and_canary_key(server):
    def spec(body: dict, headers: dict | None = None) -> dict:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello there", "max_tokens": 2,
                                                             "temperature": 0, **body},
                       headers={**AUTH, **(headers or {})}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["specops"]

    assert spec({})["request_class"] == "general"
    assert spec({"metadata": {"task": "code"}})["request_class"] == "code"  # label rule of the default policy
    assert spec({}, {"x-specops-label-task": "code"})["request_class"] == "code"
    assert spec({"metadata": {"task": "prose"}})["request_class"] == "general"
    first = spec({"user": "alice"}, {"x-specops-routing-key": "bob"})
    assert first["canary"] is False and first["revision"] is not None


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "x " * 1100}, 400, "prompt"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": [5, 99999]}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
])
def test_bad_requests_name_the_parameter(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_bad_chat_and_json(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]},
                   headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0]")
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={**AUTH, "content-type":
                                                                                  "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_oversized_bodies_are_refused_without_reading_them_whole(server):
    big = b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    r = httpx.post(f"{server.url}/v1/completions", content=big, headers={**AUTH, "content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and "error" in r.json()

    def chunks():  # no Content-Length: chunked transfer encoding
        for _ in range(6):
            yield b"x" * (1024 * 1024)

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(),
                   headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body over")


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200  # probes need no key
    health = httpx.get(f"{server.url}/health", timeout=30)  # the name vLLM / SGLang / llama-server answer
    assert health.status_code == 200 and health.text == "ok\n"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_queue_full_429_then_disconnect_frees_everything(server):
    long = {"prompt": "def f(x):", "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}
    client = httpx.Client(timeout=60, headers=AUTH)
    streams = []
    try:
        for _ in range(4):  # --max-batch 2 + --max-queue 2
            cm = client.stream("POST", f"{server.url}/v1/completions", json=long)
            r = cm.__enter__()
            assert r.status_code == 200
            streams.append((cm, r))
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH, timeout=30)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        assert _ready(server)["engine"]["inflight"] == 4
    finally:
        for cm, _ in streams:
            cm.__exit__(None, None, None)
        client.close()
    _wait(lambda: (lambda e: e["inflight"] == 0 and e["active"] == 0 and e["waiting"] == 0
                   and e["kv_blocks_used"] == 0)(_ready(server)["engine"]), 30, "aborted requests to be freed")
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    aborted = [line for line in metrics.splitlines() if line.startswith('specops_serving_requests_total{status="aborted"}')]
    assert aborted and float(aborted[0].split()[-1]) >= 4


def test_non_streaming_disconnect_aborts(server):
    # the client gives up after 0.25 s: 900 tokens would need 3,600 tok/s to come back by then (a fast
    # 2-core host served this request, speculating, in under 1 s, the wait this test used before)
    body = {"prompt": "def f(x):", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(30, read=0.25))
    _wait(lambda: (lambda e: e["inflight"] == 0 and e["kv_blocks_used"] == 0)(_ready(server)["engine"]), 30,
          "the abandoned request to be aborted")


# -- bench serve against this server ------------------------------------------------------
def test_bench_serve_modes_against_the_live_server(server, redis_box):
    from specops.bench.serve import ServeBenchConfig, format_table, run_bench_serve

    cfg = ServeBenchConfig(base_url=server.url, redis_url=f"redis://127.0.0.1:{redis_box['port']}/0", namespace=NS,
                           modes=["off", "fixed"], concurrency=[1, 2], num_prompts=3, max_tokens=24,
                           mix={"prose": 1.0}, api_key=KEY, warmup=1, progress=False)
    report = run_bench_serve(cfg)
    rows = report["results"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("off", 1), ("off", 2), ("fixed", 1), ("fixed", 2)]
    for r in rows:
        assert r["requests"] == 3 and r["errors"] == 0, r["error_samples"]
        assert r["output_tokens_per_s"] * r["duration_s"] == pytest.approx(3 * 24)  # ignore_eos: all 24 tokens
        assert r["ttft_p50_s"] > 0 and r["tpot_p99_s"] > 0
    assert all(r["acceptance_rate"] is None for r in rows if r["mode"] == "off")  # nothing drafted
    # no canary and no fallen-back class here: nothing observed, nothing decoded plainly for a fallback
    assert all((r["observed_requests"], r["fallen_back_requests"]) == (0, 0) for r in rows)
    assert all(r["decode_steps"] > 0 and r["prefix_hit_blocks"] >= 0 for r in rows)
    # what the planner did, from the server's /metrics: off never speculates, fixed (draft on the docstrings'
    # class, `general`, where the bundled draft is accepted most) does
    assert all(r["spec_step_share"] == 0.0 and r["vetoes"] == 0 for r in rows if r["mode"] == "off")
    assert any(r["spec_step_share"] > 0 for r in rows if r["mode"] == "fixed"), [
        (r["mode"], r["concurrency"], r["spec_step_share"], r["vetoes"], r["acceptance_rate"], r.get("settings"))
        for r in rows]
    assert "spec%" in format_table(report)
    # each cell's requests by class of the revision the server runs (read from its Redis namespace)
    assert report["classes"] == {str(c): {"sampled": 0, "code": 0, "factual": 0, "general": 3} for c in (1, 2)}
    assert all(r["server_cpu_ms_per_token"] > 0 for r in rows)  # the server's process_cpu_seconds_total
    assert rows[0]["settings"]["code"] == "off" and rows[2]["settings"]["code"].startswith("draft γ")
    assert "fixed" in format_table(report)
    classes = _ready(server)["policy"]["classes"]
    assert classes["code"]["method"] == "draft"  # fixed: the policy's initial settings are back


# -- the live policy ---------------------------------------------------------------------
def _code_request(server) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 2, "temperature": 0},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["specops"]


def _code_method(server) -> str:
    return _ready(server)["policy"]["classes"]["code"]["method"]


def test_policy_change_applied_while_serving(server, redis_box):
    from dataclasses import replace

    store = _store(redis_box)
    before = store.effective()["code"]
    assert _code_request(server)["method"] == "draft"
    store.set_effective({"code": replace(before, method="off")}, epoch=None, reason="test")
    _wait(lambda: _code_method(server) == "off", POLICY_CHANGE_S, "the server to apply method off")
    spec = _code_request(server)
    assert spec["method"] == "ar" and spec["fallback_reason"] == "method_off"
    store.set_effective({"code": before}, epoch=None, reason="test")
    _wait(lambda: _code_method(server) == "draft", POLICY_CHANGE_S, "the server to apply method draft again")
    assert _code_request(server)["method"] == "draft"


def test_canary_routing_key_from_user_or_header(server, redis_box):
    from specops.policies import load_policy
    from specops.policies import rollout as machine
    from specops.policies.rollout import pick_revision

    store = _store(redis_box)
    path = ROOT / "examples" / "policies" / "default.yaml"
    text = path.read_text().replace('version: "2026-12-04.1"', 'version: "canary-test"')
    assert text != path.read_text()
    from specops.policies.loader import parse_policy

    state = machine.start_rollout(store, parse_policy(text, "canary.yaml"), text, actor="test")
    stable = store.current_revision()
    try:
        _wait(lambda: (_ready(server)["policy"]["canary"] or {}).get("revision") == state.revision, 10,
              "the canary to be seen")
        keys = [f"user-{i}" for i in range(30)]
        expected = [pick_revision(state, stable, k) for k in keys]
        assert state.revision in expected and stable in expected  # the 30 keys hit both revisions
        for key, rev in zip(keys, expected):
            via_user = _spec_for({"user": key}, server)
            via_header = _spec_for({"user": "someone-else"}, server, {"x-specops-routing-key": key})
            assert via_user["revision"] == via_header["revision"] == rev
            assert via_user["canary"] is (rev != stable)
    finally:
        machine.abort(store, reason="test over")
    assert load_policy(path).version == "2026-12-04.1"


def _spec_for(body: dict, server, headers: dict | None = None) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 1, "temperature": 0,
                                                         **body}, headers={**AUTH, **(headers or {})}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["specops"]


def test_flushall_keeps_last_good_settings_and_says_stale(server, redis_box):
    from dataclasses import replace

    from specops.policies import load_policy
    from specops.policies import rollout as machine

    store = _store(redis_box)
    eff = store.effective()["code"]
    store.set_effective({"code": replace(eff, gamma=2)}, epoch=None, reason="test")
    _wait(lambda: _ready(server)["policy"]["classes"]["code"]["gamma"] == 2, 10, "gamma 2 applied")
    store.redis.flushall()
    status = _wait(lambda: (lambda s: s if s["policy"]["stale_reason"] == "redis_empty" else None)(_ready(server)),
                   10, "the stale flag")
    assert status["ready"] is True and status["policy"]["live"] is False
    assert status["policy"]["classes"]["code"]["gamma"] == 2  # last good values kept
    spec = _code_request(server)
    assert spec["request_class"] == "code" and spec["method"] == "draft" and spec["gamma"] == 2
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert "specops_serving_policy_stale 1.0" in metrics
    path = ROOT / "examples" / "policies" / "default.yaml"
    machine.start_rollout(store, load_policy(path), path.read_text(), actor="test")  # an operator re-seeds
    _wait(lambda: _ready(server)["policy"]["live"], 10, "live again after re-seeding")


def test_redis_restart_mid_load_no_failed_request_no_lost_record(server, redis_box):
    from specops.telemetry.redis_metrics import RedisWindowReader

    store = _store(redis_box)

    def published() -> int:
        reader = RedisWindowReader(store.redis, namespace=NS)
        return sum(reader.window(c, 3000).requests for c in reader.classes())

    _wait(lambda: _ready(server)["policy"]["records_buffered"] == 0, 20, "an empty record buffer")
    baseline = published()
    ok, failed = [0], []
    stop = threading.Event()

    def load(i: int) -> None:
        with httpx.Client(timeout=60, headers=AUTH) as c:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    r = c.post(f"{server.url}/v1/completions",
                               json={"prompt": f"def f{i}_{n}(x):", "max_tokens": 4, "temperature": 0})
                    if r.status_code == 200:
                        ok[0] += 1
                    else:
                        failed.append(r.text)
                except httpx.HTTPError as exc:
                    failed.append(repr(exc))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        _wait(lambda: ok[0] >= 3, 60, "load before the outage")
        redis_box["svc"].stop()  # SIGTERM: the append-only file keeps what was written
        status = _wait(lambda: (lambda s: s if s["policy"]["stale_reason"] == "redis_unreachable" else None)(
            _ready(server)), 15, "the server to notice the outage")
        assert status["ready"] is True
        during = ok[0]
        _wait(lambda: ok[0] >= during + 3, 60, "requests served while Redis is down")
        assert _ready(server)["policy"]["records_buffered"] > 0
        redis_box["svc"] = _start_redis(redis_box["dir"], redis_box["port"])
        _wait(lambda: _ready(server)["policy"]["live"], 20, "live again after the restart")
        after = ok[0]
        _wait(lambda: ok[0] >= after + 2, 60, "requests after the restart")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failed == []
    _wait(lambda: _ready(server)["policy"]["records_buffered"] == 0, 20, "the buffer to flush")
    assert published() - baseline == ok[0]
