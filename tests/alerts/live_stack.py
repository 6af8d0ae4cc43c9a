"""A live specops stack for the dashboard tests: ``specops serve`` + controller + real Prometheus.

* ``specops serve`` as a subprocess on the bundled models (its OpenAI API, continuous
  batching, the live policy from Redis, the telemetry contract on its ``/metrics``),
  with draft, Medusa and n-gram classes plus an ``off`` class, getting real HTTP load:
  completions from a few concurrent clients, the class chosen by the request's
  ``metadata``;
* ``specops controller run`` as a subprocess on the same Redis, serving its ``/metrics``;
* a real redis-server started here (or the one at ``redis_url``) holding the policy;
* a real Prometheus (1 s scrapes of the server and the controller, the policy's
  rendered alert rules loaded).

Run as a script it serves traffic for a while and writes the dashboard snapshot used
in docs/ops.md::

    PYTHONPATH=. python -m tests.alerts.live_stack --seconds 240 --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.services import Service, free_port, require_binary, start_redis, start_service, wait_for_port

ROOT = Path(__file__).resolve().parents[2]

POLICY = """
version: live-1
description: dashboard test fleet
default_class: general
classes:
  - name: code
    match: [{label: {task: code}}]
    method: draft
    gamma: {initial: 4, min: 1, max: 8}
    adaptation: {mode: goodput, cooldown_s: 3, dead_band: 0.02}
  - name: facts
    match: [{label: {task: facts}}]
    method: medusa
    medusa_heads: {initial: 3, min: 1, max: 3}
    adaptation: {mode: fixed}
  - name: chat
    match: [{label: {task: chat}}]
    method: ngram
    gamma: {initial: 3, min: 1, max: 6}
    adaptation: {mode: bandit, cooldown_s: 3}
  - name: general
    method: "off"
alerts:
  - {name: low-acceptance, metric: acceptance_rate, op: "<", threshold: 0.5, for_s: 3600, min_samples: 5,
     action: notify, severity: warning}
  - {name: slower-than-plain, metric: speedup, op: "<", threshold: 0.2, for_s: 3600, min_samples: 5,
     action: fallback, severity: critical}
  - {name: heads-weak, metric: head_accuracy, op: "<", threshold: 0.01, for_s: 3600, min_samples: 5,
     action: notify, severity: info, classes: [facts]}
  - {name: slow-stream, metric: tokens_per_s, op: "<", threshold: 1, for_s: 3600, min_samples: 5,
     action: notify, severity: info}
  - {name: slow-tokens, metric: p99_token_latency_s, op: ">", threshold: 30, for_s: 3600, min_samples: 5,
     action: notify, severity: info}
rollout:
  steps: [{weight: 100}]
"""

TASKS = ("code", "facts", "chat", "general")
RULE_WINDOW = "15s"
PROMPTS = {"code": "def add(a, b):\n    return", "facts": "What is the capital of France?",
           "chat": "Hello! Hello! How are you today? How are", "general": "Once upon a time"}
READY_TIMEOUT_S = 120.0


class LiveStack:
    """Start with `start()`, drive with `serve_for()`, always `stop()` (kills what it started, by PID)."""

    def __init__(self, workdir: Path, *, redis_url: str | None = None, clients: int = 2, policy: str = POLICY,
                 controller_window_s: float = 10.0) -> None:
        self.workdir = workdir
        self.redis_url = redis_url
        self.clients = clients  # concurrent HTTP clients of the traffic
        self.policy_text = policy  # the stack's policy (POLICY: the query test's, whose alerts never fire)
        self.controller_window_s = controller_window_s
        self.services: list = []
        self.server: Service | None = None
        self.prometheus_url = ""
        self.controller_metrics_url = ""
        self.rng = random.Random(5)

    # ------------------------------------------------------------------ start
    def start(self) -> LiveStack:
        prometheus = require_binary("prometheus")
        import redis as redis_lib

        from specops.alerts.render import RenderOptions, render
        from specops.policies import load_policy
        from specops.policies import rollout as machine
        from specops.policies.store import PolicyStore

        if self.redis_url is None:
            svc = start_redis(self.workdir / "redis")
            self.services.append(svc)
            self.redis_url = f"redis://127.0.0.1:{svc.port}/0"
        self.client = redis_lib.Redis.from_url(self.redis_url)
        policy = load_policy(self.policy_text)
        self.policy = policy
        self.store = PolicyStore(self.client)
        # stored before either process starts, so neither bootstraps its own default policy
        machine.start_rollout(self.store, policy, self.policy_text, actor="live-stack")
        policy_file = self.workdir / "policy.yaml"
        policy_file.write_text(self.policy_text)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}

        # the inference server, as operators run it: bundled models, this Redis, this policy
        server_port = free_port()
        argv = [sys.executable, "-m", "specops.cli", "serve", "--redis", self.redis_url, "--policy", str(policy_file),
                "--port", str(server_port), "--pod", "live-0", "--max-batch", "4", "--kv-cache-mb", "16",
                "--reconcile-s", "0.5", "--threads", "1", "--log-level", "warning"]
        self.server = _start_env("serve", argv, server_port, self.workdir / "serve", env)
        self.services.append(self.server)
        self._wait_ready()

        # the controller, as operators run it
        controller_port = free_port()
        argv = [sys.executable, "-m", "specops.cli", "controller", "run", "--redis", self.redis_url, "--interval", "1",
                "--window", f"{self.controller_window_s:g}", "--listen", f"127.0.0.1:{controller_port}", "--webhook-token", "live"]
        self.services.append(_start_env("controller", argv, controller_port, self.workdir / "controller", env))
        self.controller_metrics_url = f"http://127.0.0.1:{controller_port}/metrics"

        # Prometheus scraping both, with the policy's alert rules
        rules = self.workdir / "rules.yaml"
        rules.write_text(render(policy, "prometheus", RenderOptions(window=RULE_WINDOW, interval="1s")))
        config = self.workdir / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{rules}]\n"
            "scrape_configs:\n"
            f"  - job_name: specops-serve\n    static_configs: [{{targets: ['127.0.0.1:{server_port}']}}]\n"
            f"  - job_name: specops-controller\n    static_configs: [{{targets: ['127.0.0.1:{controller_port}']}}]\n")
        port = free_port()
        argv = [prometheus, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        self.services.append(start_service("prometheus", argv, port, self.workdir / "prometheus", timeout_s=60))
        self.prometheus_url = f"http://127.0.0.1:{port}"
        return self

    def _wait_ready(self) -> None:
        """Until the server's models are loaded and calibrated (``/readyz`` 200), bounded."""
        from specops.bench.serve import BenchServeError, _wait_ready

        assert self.server is not None
        try:
            _wait_ready(self.server.url, READY_TIMEOUT_S, self.server.proc)
        except BenchServeError as exc:
            raise RuntimeError(f"specops serve: {exc}\n{self.server.log()}") from None

    # ------------------------------------------------------------------ traffic
    def serve_for(self, seconds: float, max_new_tokens: int = 24) -> int:
        """``clients`` concurrent HTTP clients send completions round-robin over the classes for
        ``seconds``; returns the requests served. Any failed request raises."""
        import httpx

        assert self.server is not None
        deadline = time.monotonic() + seconds
        served = [0] * self.clients
        errors: list[str] = []

        def client(k: int) -> None:
            rng = random.Random(self.rng.randrange(1 << 30))
            with httpx.Client(base_url=self.server.url, timeout=60) as http:
                n = k
                while time.monotonic() < deadline and not errors:
                    task = TASKS[n % len(TASKS)]
                    body = {"model": "bundled", "prompt": PROMPTS[task], "max_tokens": max_new_tokens,
                            "temperature": 0, "seed": rng.randrange(1 << 30), "metadata": {"task": task}}
                    r = http.post("/v1/completions", json=body)
                    if r.status_code != 200:
                        errors.append(f"{task}: HTTP {r.status_code} {r.text[:300]}")
                        return
                    served[k] += 1
                    n += 1

        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + 120)
        if errors:
            raise RuntimeError(f"a request failed: {errors[0]}\n{self.server.log()}")
        return sum(served)

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        for svc in reversed(self.services):
            svc.stop(timeout_s=20)


def _start_env(name: str, argv: list[str], port: int, workdir: Path, env: dict) -> Service:
    """`start_service` with an environment (the processes need PYTHONPATH)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    svc = Service(name=name, proc=proc, port=port, workdir=workdir, log_path=log_path)
    try:
        wait_for_port(port, 60, proc)
    except Exception as exc:
        svc.stop()
        raise RuntimeError(f"{name} did not start: {exc}\n{svc.log()}") from exc
    return svc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = parser.parse_args(argv)
    from specops.alerts.prometheus_api import PrometheusClient
    from specops.alerts.snapshot import snapshot

    with tempfile.TemporaryDirectory(prefix="specops-live-") as tmp:
        stack = LiveStack(Path(tmp)).start()
        try:
            served = stack.serve_for(args.seconds)
            time.sleep(3)
            counts = snapshot(PrometheusClient(stack.prometheus_url), args.out, range_s=args.seconds + 5,
                              rate_window="20s")
        finally:
            stack.stop()
    print(f"served {served} requests; wrote {args.out}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
