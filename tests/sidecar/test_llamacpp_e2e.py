"""End to end on real processes: two llama.cpp ``llama-server`` pools (n-gram speculative and
plain, flags from ``specops engine-config --engine llamacpp``) on the bundled target converted
to GGUF, ``specops sidecar --engine llamacpp`` in front of them, a real Redis and a real
``specops controller run``.

Traffic of two classes (`specops.bench.llamacpp_pools.POLICY`): greedy ``code`` whose n-gram
drafts are accepted, and ``creative`` (the same code prompts at temperature 1) whose drafts
are not. The controller falls ``creative`` back within its windows, the sidecar moves it to
the plain pool, probes keep a share of it speculating, ``code`` stays speculative; a stream
relayed through the sidecar is the engine's, event for event; records made while Redis is
down reach it after its restart.

Skipped with the reason when llama-server is not built (``make peers``), gguf or
redis-server are missing; under ``SPECOPS_REQUIRE_SERVICES=1`` (CI) that is a failure.
Bounded: the pools load in about a second, the fallback takes a few controller windows.
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

from specops.bench.llamacpp_pools import Pool, bundled_gguf, pool_args, start_pool, write_policy
from tests.services import (
    Service,
    free_port,
    redis_server_binary,
    require_module,
    start_service,
    wait_for_port,
    wait_until,
)
from tests.sidecar.llamacpp_support import require_llama_binary

ROOT = Path(__file__).resolve().parents[2]
NS = "llama"
CODE_PROMPT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
               "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")
MAX_TOKENS = 48


def _redis(workdir: Path, port: int) -> Service:
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--dir", str(workdir)]
    return start_service("redis", argv, port, workdir)


def _spawn(name: str, argv: list[str], workdir: Path, port: int) -> Service:
    log = workdir / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "specops.cli", *argv], cwd=workdir,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Service(name, proc, port, workdir, log)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    binary = require_llama_binary("llama-server")
    require_module("gguf", "converting the bundled target to GGUF")
    redis_server_binary()
    model = bundled_gguf()
    work = tmp_path_factory.mktemp("llamacpp")
    policy = write_policy(work / "policy.yaml")
    rport = free_port()
    box = {"redis": _redis(work, rport), "rport": rport, "dir": work}
    redis_url = f"redis://127.0.0.1:{rport}/0"
    pools: list[Pool] = []
    services: list[Service] = []
    try:
        for name in ("spec", "plain"):
            pools.append(start_pool(name, model, free_port(), pool_args(policy, name, threads=1, parallel=2), work,
                                    binary=binary))
        box["spec"], box["plain"] = pools
        cport = free_port()
        ctl = _spawn("controller", ["controller", "run", "--redis", redis_url, "--namespace", NS, "--policy",
                                    str(policy), "--interval", "1", "--window", "8", "--lease-ttl-ms", "3000",
                                    "--listen", f"127.0.0.1:{cport}", "--webhook-token", "e2e", "--log-level", "info"],
                     work, cport)
        services.append(ctl)
        wait_for_port(cport, 60, ctl.proc)  # it stores the policy first: the sidecar finds it current
        sport = free_port()
        side = _spawn("sidecar", ["sidecar", "--engine", "llamacpp", "--upstream", f"spec={pools[0].url}",
                                  "--upstream", f"plain={pools[1].url}", "--policy", str(policy), "--redis", redis_url,
                                  "--namespace", NS, "--listen", f"127.0.0.1:{sport}", "--reconcile-s", "0.5",
                                  "--scrape-s", "0.5", "--log-level", "warning"], work, sport)
        services.append(side)
        box["side"], box["controller"] = side, ctl
        wait_for_port(sport, 60, side.proc)
        wait_until(lambda: httpx.get(f"{side.url}/readyz", timeout=5).status_code == 200, "sidecar ready", 60)
        yield box
    finally:
        for svc in reversed(services):
            svc.stop(timeout_s=20)
        for pool in pools:
            pool.stop()
        box["redis"].stop()


def _post(box, prompt: str, temperature: float, **extra) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 7, **extra}
    return httpx.post(f"{box['side'].url}/v1/completions", json=body, timeout=60)


def _effective(box) -> dict:
    import redis

    from specops.policies.store import PolicyStore

    return PolicyStore(redis.Redis(host="127.0.0.1", port=box["rport"]), namespace=NS).effective()


def _window(box, name: str):
    import redis

    from specops.telemetry.redis_metrics import RedisWindowReader

    return RedisWindowReader(redis.Redis(host="127.0.0.1", port=box["rport"]), namespace=NS).window(name, 600)


def _code_prompts() -> list[str]:
    """bench serve's code prompts (the bundled suite): code the n-gram lookup finds again in its context."""
    from specops.bench.serve import ServeBenchConfig, build_prompts

    return [text for text, _ in build_prompts(ServeBenchConfig(seed=0, mix={"code": 1.0}), 16)]


class _Traffic:
    """Both classes' requests from two threads until stopped; every answer's headers kept."""

    def __init__(self, box) -> None:
        self.box = box
        self.prompts = _code_prompts()
        self.stop = threading.Event()
        self.seen: list[tuple[str, str, bool, float]] = []   # (class, pool, probe, time)
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self.run, args=(t,), daemon=True) for t in (0.0, 1.0)]

    def run(self, temperature: float) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                r = _post(self.box, self.prompts[i % len(self.prompts)], temperature, seed=i, ignore_eos=True)
            except httpx.HTTPError as exc:
                self.errors.append(repr(exc))
                continue
            if r.status_code != 200:
                self.errors.append(f"{r.status_code} {r.text[:200]}")
                continue
            self.seen.append((r.headers["x-specops-class"], r.headers["x-specops-pool"],
                              r.headers.get("x-specops-probe") == "1", time.monotonic()))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(70)


def test_controller_falls_the_sampled_class_back_and_the_sidecar_moves_it(stack):
    t0 = time.monotonic()
    with _Traffic(stack) as traffic:
        wait_until(lambda: _effective(stack)["creative"].fallback_active, "creative fallen back by the controller",
                   timeout_s=60)
        fell_at = time.monotonic()
        def moved() -> bool:
            later = [(c, p, probe) for c, p, probe, t in traffic.seen if c == "creative" and t > fell_at + 1.0]
            return sum(1 for _, p, _ in later if p == "plain") >= 3 and any(
                probe and p == "spec" for _, p, probe in later)

        wait_until(moved, "creative on the plain pool, with probes on the spec pool", timeout_s=40)
    assert not traffic.errors, traffic.errors[:3]
    eff = _effective(stack)
    assert eff["creative"].fallback_active and not eff["code"].fallback_active
    after = [(c, p, probe) for c, p, probe, t in traffic.seen if t > fell_at + 1.0]
    assert all(p == "spec" for c, p, _ in after if c == "code")
    assert all(p == "plain" for c, p, probe in after if c == "creative" and not probe)
    code, creative = _window(stack, "code"), _window(stack, "creative")
    assert code.drafted > 0 and code.accepted / code.drafted >= 0.15
    assert creative.drafted > 0 and creative.accepted / creative.drafted < 0.15
    assert time.monotonic() - t0 < 100
    metrics = httpx.get(f"{stack['side'].url}/metrics", timeout=10).text
    assert 'llamacpp:spec_decode_num_draft_tokens_total{pool="spec"}' in metrics
    assert 'llamacpp:tokens_predicted_total{pool="plain"}' in metrics


def _events(url: str, body: dict) -> tuple[list[dict], bytes]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    out = []
    for ev in raw.split(b"\n\n"):
        if ev.startswith(b"data: ") and ev != b"data: [DONE]":
            e = json.loads(ev[6:])
            for key in ("id", "created", "timings"):  # per request by design (ids, clock, measured times)
                e.pop(key, None)
            out.append(e)
    return out, raw


def test_stream_relayed_event_for_event(stack):
    # cache_prompt off: the second request must not reuse the first one's prompt cache (usage would differ)
    body = {"model": "m", "prompt": CODE_PROMPT, "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": False}
    direct, direct_raw = _events(stack["spec"].url, body)
    through, through_raw = _events(stack["side"].url, body)
    assert through == direct and len(through) >= 3
    assert through_raw.endswith(b"data: [DONE]\n\n") and direct_raw.endswith(b"data: [DONE]\n\n")
    # the speculative pool's final event carries its drafted / accepted counts, read by the sidecar
    last = json.loads(through_raw.split(b"\n\n")[-3][6:])
    assert last["timings"]["predicted_n"] == 24


def test_records_made_while_redis_is_down_arrive_after_its_restart(stack):
    time.sleep(1.5)  # the earlier tests' last records have been flushed
    before = _window(stack, "code").requests
    stack["redis"].stop()
    try:
        sent = 0
        for _ in range(4):
            r = _post(stack, CODE_PROMPT, 0.0)
            assert r.status_code == 200 and r.headers["x-specops-pool"] == "spec", r.text
            sent += 1
    finally:
        stack["redis"] = _redis(stack["dir"], stack["rport"])
    wait_until(lambda: _window(stack, "code").requests >= before + sent, "buffered records flushed", timeout_s=30)
    time.sleep(1.5)  # one more flush period: nothing counted twice either
    assert _window(stack, "code").requests == before + sent
