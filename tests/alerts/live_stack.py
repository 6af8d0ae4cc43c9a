"""A live specops stack for the dashboard tests: runtime + controller + real Prometheus.

* a `PolicyRuntime` serving real models (tiny seeded ones by default, the bundled
  ones with ``bundled=True``) — draft, Medusa and n-gram classes plus an ``off``
  class — following the controller's settings in Redis, exporting the telemetry
  contract on its own ``/metrics`` (prometheus_client's HTTP server);
* ``specops controller run`` as a subprocess on the same Redis, serving its
  ``/metrics``;
* a real Prometheus (1 s scrapes of both, the policy's rendered alert rules loaded).

Until ``specops serve`` exists this stands in for an inference pod. Run as a script it
serves traffic for a while and writes the dashboard snapshot used in the README::

    PYTHONPATH=. python -m tests.alerts.live_stack --bundled --seconds 240 --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.services import free_port, require_binary, start_redis, start_service, wait_for_port

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


def _tiny_decoder():
    from specops.decoder import Decoder
    from specops.decoder.medusa_heads import MedusaHeads
    from tests.decoder.tiny_models import perturbed, tiny_llama

    target = tiny_llama(seed=11)
    return Decoder(target, draft=perturbed(target, 0.05), medusa=MedusaHeads.from_model(target, num_heads=3))


def _bundled_decoder():
    import torch

    from specops.decoder import Decoder

    torch.set_num_threads(1)  # a small shared CPU: one intra-op thread is ~10x faster than two contending

    return Decoder.from_pretrained("bundled")


class LiveStack:
    """Start with `start()`, drive with `serve_for()`, always `stop()` (kills what it started, by PID)."""

    def __init__(self, workdir: Path, *, redis_url: str | None = None, bundled: bool = False) -> None:
        self.workdir = workdir
        self.redis_url = redis_url
        self.bundled = bundled
        self.services: list = []
        self.watcher = None
        self.http = None
        self.prometheus_url = ""
        self.controller_metrics_url = ""
        self.rng = random.Random(5)

    # ------------------------------------------------------------------ start
    def start(self) -> LiveStack:
        prometheus = require_binary("prometheus")
        import redis as redis_lib
        from prometheus_client import CollectorRegistry, start_http_server

        from specops.alerts.render import RenderOptions, render
        from specops.policies import load_policy
        from specops.policies import rollout as machine
        from specops.policies.store import PolicyStore
        from specops.serving.live_policy import LivePolicy
        from specops.serving.policy_runtime import PolicyRuntime
        from specops.telemetry.exporter import PrometheusExporter
        from specops.telemetry.redis_metrics import RedisPublisher

        if self.redis_url is None:
            svc = start_redis(self.workdir / "redis")
            self.services.append(svc)
            self.redis_url = f"redis://127.0.0.1:{svc.port}/0"
        self.client = redis_lib.Redis.from_url(self.redis_url)
        policy = load_policy(POLICY)
        self.policy = policy
        self.store = PolicyStore(self.client)
        machine.start_rollout(self.store, policy, POLICY, actor="live-stack")

        # the runtime: models, live settings, telemetry to Redis and to its /metrics
        registry = CollectorRegistry()
        decoder = _bundled_decoder() if self.bundled else _tiny_decoder()
        self.watcher = LivePolicy(self.store, reconcile_s=0.5)
        self.runtime = PolicyRuntime(decoder, store=self.store, live=self.watcher,
                                     publisher=RedisPublisher(self.client, pod="live-0"),
                                     exporter=PrometheusExporter(registry), rng=random.Random(3))
        self.runtime_port = free_port()
        self.http = start_http_server(self.runtime_port, addr="127.0.0.1", registry=registry)

        # the controller, as operators run it
        controller_port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, "-m", "specops.cli", "controller", "run", "--redis", self.redis_url, "--interval", "1",
                "--window", "10", "--listen", f"127.0.0.1:{controller_port}", "--webhook-token", "live"]
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
            f"  - job_name: specops-runtime\n    static_configs: [{{targets: ['127.0.0.1:{self.runtime_port}']}}]\n"
            f"  - job_name: specops-controller\n    static_configs: [{{targets: ['127.0.0.1:{controller_port}']}}]\n")
        port = free_port()
        argv = [prometheus, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        self.services.append(start_service("prometheus", argv, port, self.workdir / "prometheus", timeout_s=60))
        self.prometheus_url = f"http://127.0.0.1:{port}"
        return self

    # ------------------------------------------------------------------ traffic
    def serve_one(self, task: str, max_new_tokens: int = 24) -> None:
        if self.bundled:
            prompts = {"code": "def add(a, b):\n    return", "facts": "What is the capital of France?",
                       "chat": "Hello! Hello! How are you today? How are", "general": "Once upon a time"}
            prompt: str | list[int] = prompts[task]
        else:
            base = [self.rng.randrange(96) for _ in range(6)]
            prompt = base * 3 if task == "chat" else base  # repetition gives the n-gram drafter matches
        self.runtime.serve(prompt, labels={"task": task}, max_new_tokens=max_new_tokens,
                           temperature=0.0, seed=self.rng.randrange(1 << 30))

    def serve_for(self, seconds: float, max_new_tokens: int = 24) -> int:
        """Round-robin traffic over the classes for ``seconds``; returns requests served."""
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            self.serve_one(TASKS[n % len(TASKS)], max_new_tokens)
            n += 1
        return n

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        if self.http is not None:
            server = self.http[0] if isinstance(self.http, tuple) else None
            if server is not None:
                server.shutdown()
                server.server_close()
        if self.watcher is not None:
            self.watcher.close()
        for svc in reversed(self.services):
            svc.stop()


def _start_env(name: str, argv: list[str], port: int, workdir: Path, env: dict) -> object:
    """`start_service` with an environment (the controller needs PYTHONPATH)."""
    from tests.services import Service

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
    parser.add_argument("--bundled", action="store_true", help="serve the bundled models (default: tiny ones)")
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = parser.parse_args(argv)
    from specops.alerts.prometheus_api import PrometheusClient
    from specops.alerts.snapshot import snapshot

    with tempfile.TemporaryDirectory(prefix="specops-live-") as tmp:
        stack = LiveStack(Path(tmp), bundled=args.bundled).start()
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
