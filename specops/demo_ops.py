"""The ops half of ``specops demo``: real decoding under a live policy and control loop.

`run_ops_demo_http` (what ``specops demo`` runs) makes every part its own process:
an embedded Redis, ``specops serve`` driven over HTTP, and ``specops controller run``,
in real time with the policy's durations scaled down (`fast_policy_text`).

`run_ops_demo` is the in-process variant for the library: everything is real except
the wall clock of the control loop: an embedded Redis
server that specops starts itself, the example policy stored as revision 1, the
bundled models serving a mixed stream of requests through `PolicyRuntime` (which
reads the controller's per-class settings and publishes every request's telemetry
to Redis), and the real `Controller` ticking over those metric windows. Time is
simulated — each round of requests advances the clock by ``tick_s`` — so cooldowns,
``for`` durations and metric windows play out in a minute instead of an hour; every
token, acceptance and timing figure is measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples" / "policies"
DEFAULT_POLICY = EXAMPLES_DIR / "default.yaml"
BAD_CANARY_POLICY = EXAMPLES_DIR / "demo-bad-canary.yaml"


class SimClock:
    """A clock that only moves when told to (starts at the real time)."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class Traffic:
    """One stream of demo requests: prompts, their labels and sampling temperature."""

    name: str
    prompts: list[str]
    labels: dict[str, str] = field(default_factory=dict)
    temperature: float = 0.0


@dataclass
class RoundReport:
    """One round: what was served per class, and what the controller decided after it."""

    index: int
    served: dict[str, dict[str, Any]]          # class -> {requests, methods, accepted, drafted, tokens, wall_s}
    settings: dict[str, dict[str, Any]]        # class -> effective settings after the tick
    decisions: list[dict[str, Any]]            # decisions that changed something
    rollout: str = ""                          # rollout phase after the tick (when one ran)


def demo_traffic(seed: int = 0, per_kind: int = 4) -> list[Traffic]:
    """Code completion (labelled ``task=code``), factual questions and hot creative prose."""
    from specops.bench.suites import builtin_suite

    code = [p.text for p in builtin_suite("code", seed=seed)][:per_kind]
    prose = [p.text for p in builtin_suite("prose", seed=seed)][:per_kind]
    factual = [
        "What does the function below return?\n\ndef area(r):\n    return 3.14159 * r * r\n",
        "Which module in the standard library parses command-line options?\n",
        "How many arguments does the function below take?\n\ndef f(a, b, *args, **kw):\n    pass\n",
        "What is the output of print(sorted([3, 1, 2]))?\n",
    ][:per_kind]
    return [
        Traffic("code", code, labels={"task": "code"}),
        Traffic("factual", factual),
        Traffic("creative", prose, temperature=1.0),
    ]


def chat_demo_traffic(per_kind: int = 4) -> list[Traffic]:
    """For a chat model: user messages from the chat-model suites' prompt sets
    (`specops.bench.chat_prompts`): coding requests (labelled ``task=code``), factual questions
    and creative writing sampled at temperature 1.0."""
    from specops.bench import chat_prompts

    return [
        Traffic("code", chat_prompts.CODE[:per_kind], labels={"task": "code"}),
        Traffic("factual", chat_prompts.QA[:per_kind]),
        Traffic("creative", chat_prompts.CREATIVE[:per_kind], temperature=1.0),
    ]


def _summarise(served: list[Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for s in served:
        row = out.setdefault(s.request_class, {"requests": 0, "methods": set(), "accepted": 0, "drafted": 0,
                                               "tokens": 0, "wall_s": 0.0, "fallbacks": 0})
        row["requests"] += 1
        row["methods"].add(s.method + ("(probe)" if s.probe else ""))
        row["accepted"] += s.stats.accepted
        row["drafted"] += s.stats.drafted
        row["tokens"] += s.stats.new_tokens
        row["wall_s"] += s.stats.wall_s
        row["fallbacks"] += 1 if s.fallback_reason else 0
    return out


def run_ops_demo(decoder: Any, *, state_dir: str | Path, policy_path: str | Path = DEFAULT_POLICY, rounds: int = 10,
                 tick_s: float = 15.0, max_new_tokens: int = 32, per_kind: int = 3, seed: int = 0,
                 canary_policy_path: str | Path | None = BAD_CANARY_POLICY, canary_round: int = 4,
                 on_round: Callable[[RoundReport], None] | None = None,
                 on_event: Callable[[str], None] | None = None) -> list[RoundReport]:
    """Run ``rounds`` rounds of demo traffic under the policy and the control loop.

    Before round ``canary_round`` (0-based) the revision in ``canary_policy_path`` is
    rolled out as a canary, exactly as ``specops policy rollout`` would; its traffic
    publishes under the canary telemetry namespace, which the controller's rollout
    analysis reads.
    """
    from prometheus_client import CollectorRegistry

    from specops.controller.controller import Controller
    from specops.controller.leader import LeaderLease
    from specops.controller.rollout_driver import canary_namespace
    from specops.controller.sources import RedisWindowSource
    from specops.policies.live import LivePolicy
    from specops.engine.policy_runtime import PolicyRuntime
    from specops.policies import load_policy
    from specops.policies import rollout as machine
    from specops.policies.redis_backend import close, connect
    from specops.policies.store import PolicyStore
    from specops.telemetry.exporter import PrometheusExporter
    from specops.telemetry.redis_metrics import RedisPublisher, RedisWindowReader

    if rounds < 1 or tick_s <= 0:
        raise ValueError("rounds must be >= 1 and tick_s > 0")
    text = Path(policy_path).read_text()
    policy = load_policy(policy_path)
    clock = SimClock()
    client = connect(None, Path(state_dir))  # an embedded, real Redis server
    namespace = f"demo-{int(clock()):d}"
    watcher = None
    try:
        store = PolicyStore(client, namespace=namespace, clock=clock)
        machine.start_rollout(store, policy, text, actor="demo")
        registry = CollectorRegistry()
        lease = LeaderLease(client, name=store.lease_name, ttl_ms=60_000)
        reader = RedisWindowReader(client, namespace=namespace, clock=clock)
        canary_ns = canary_namespace(namespace)
        canary_reader = RedisWindowReader(client, namespace=canary_ns, clock=clock)
        controller = Controller(store, RedisWindowSource(reader), clock=clock, registry=registry, lease=lease,
                                window_s=4 * tick_s, canary_source=RedisWindowSource(canary_reader))
        watcher = LivePolicy(store, reconcile_s=0.001)
        runtime = PolicyRuntime(
            decoder, store=store, live=watcher, exporter=PrometheusExporter(registry),
            publisher=RedisPublisher(client, pod="demo-pod-0", namespace=namespace, clock=clock),
            canary_publisher=RedisPublisher(client, pod="demo-pod-0", namespace=canary_ns, clock=clock))
        traffic = demo_traffic(seed, per_kind)
        reports = []
        for index in range(rounds):
            if canary_policy_path is not None and index == canary_round:
                canary_text = Path(canary_policy_path).read_text()
                state = machine.start_rollout(store, load_policy(canary_policy_path), canary_text, actor="demo")
                if on_event is not None:
                    on_event(f"rolling out {Path(canary_policy_path).name} as revision {state.revision}: "
                             f"{state.message}")
            served = []
            for stream in traffic:
                for i, prompt in enumerate(stream.prompts):
                    served.append(runtime.serve(prompt, labels=stream.labels, temperature=stream.temperature,
                                                max_new_tokens=max_new_tokens, seed=seed + 1000 * index + i,
                                                routing_key=f"{stream.name}-{index}-{i}"))
            clock.advance(tick_s)
            decisions = [d.as_dict() for d in controller.tick() if d.changed]
            settings = {name: {"method": s.method, "gamma": s.gamma, "heads": s.medusa_heads,
                               "fallback": s.fallback_active}
                        for name, s in sorted(store.effective().items())}
            state = store.rollout_state()
            rollout = f"rev {state.revision} {state.phase} {state.weight}%" if state is not None and state.stable_revision else ""
            report = RoundReport(index, _summarise(served), settings, decisions, rollout)
            reports.append(report)
            if on_round is not None:
                on_round(report)
        lease.release()
        return reports
    finally:
        if watcher is not None:
            watcher.close()
        client.connection_pool.disconnect()  # our idle pooled connections would count as other users
        close(client)


def format_round(report: RoundReport) -> str:
    """One round as a few aligned lines."""
    lines = [f"round {report.index + 1}" + (f"   [canary: {report.rollout}]" if report.rollout else "")]
    for name, row in sorted(report.served.items()):
        acc = f"{row['accepted'] / row['drafted']:.2f}" if row["drafted"] else "  - "
        tps = row["tokens"] / row["wall_s"] if row["wall_s"] > 0 else 0.0
        s = report.settings.get(name, {})
        knob = f"heads={s.get('heads')}" if s.get("method") == "medusa" else f"gamma={s.get('gamma')}"
        state = "FALLBACK" if s.get("fallback") else s.get("method", "?")
        lines.append(f"  {name:<9} {row['requests']:>2} req  ran {','.join(sorted(row['methods'])):<18} "
                     f"accept {acc}  {tps:7.1f} tok/s   -> {state:<8} {knob}")
    for d in report.decisions:
        lines.append(f"  * {d['class'] or 'rollout'}: {d['kind']} - {d['reason'][:160]}")
    return "\n".join(lines)


# -- the ops demo over HTTP: a real `specops serve` and a real `specops controller run` ----------
def fast_policy_text(path: str | Path, factor: float = 0.1) -> str:
    """The policy at ``path`` with every duration (``*_s`` except ``deadline_s``) scaled by ``factor``,
    so cooldowns, alert ``for`` durations and rollout pauses play out in a demo's minute."""
    import yaml

    def scale(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (round(v * factor, 3) if k.endswith("_s") and k != "deadline_s"
                        and isinstance(v, (int, float)) and not isinstance(v, bool) else scale(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [scale(v) for v in node]
        return node

    return yaml.safe_dump(scale(yaml.safe_load(Path(path).read_text())), sort_keys=False)


@dataclass
class HttpRound:
    """One round of the HTTP demo: per-class results from the responses, then the controller's actions."""

    index: int
    served: dict[str, dict[str, Any]]      # class -> {requests, methods, drafted, accepted, tokens, seconds, canary}
    settings: dict[str, dict[str, Any]]    # class -> effective settings in Redis after the round
    events: list[dict[str, Any]]           # audit events the controller wrote during the round
    rollout: str = ""
    errors: int = 0


def _spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None):
    import os
    import subprocess
    import sys

    log = open(log_path, "wb")
    return subprocess.Popen([sys.executable, "-m", "specops.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=dict(os.environ, **(env or {})))


def _stop_process(proc, timeout_s: float = 20.0) -> None:
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout_s)


def run_ops_demo_http(*, state_dir: str | Path, policy_path: str | Path = DEFAULT_POLICY, rounds: int = 8,
                      max_new_tokens: int = 24, per_kind: int = 3, seed: int = 0,
                      canary_policy_path: str | Path | None = BAD_CANARY_POLICY, canary_round: int = 2,
                      tick_s: float = 1.0, time_factor: float = 0.25, model: str | None = None,
                      chat: bool = False, methods: Sequence[str] | None = None,
                      on_round: Callable[[HttpRound], None] | None = None,
                      on_event: Callable[[str], None] | None = None) -> list[HttpRound]:
    """The ops loop with every part a real process: an embedded Redis (started here),
    ``specops serve`` on a free port, ``specops controller run`` ticking every ``tick_s``.

    Requests go over HTTP (labels in ``metadata``, routing keys in ``user``); what each
    response's ``specops`` object says is summed per class. Policy durations are
    scaled by ``time_factor`` (`fast_policy_text`) so the loop plays out in a minute of
    real time. Before round ``canary_round`` (0-based) the canary policy is rolled out,
    exactly as ``specops policy rollout`` would.

    ``model``: what ``specops serve --model`` loads (a registered name or a folder; None: the
    bundled models). ``methods``: the speculative methods that model has; both policies are
    rewritten for them (`specops.policies.retarget.retarget_policy`; None: as written). ``chat``: send the traffic
    of `chat_demo_traffic` as chat requests (``/v1/chat/completions``, rendered with the model's
    chat template by the server) instead of `demo_traffic`'s completions.
    """
    import secrets
    import socket
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from specops.policies import rollout as machine
    from specops.policies.loader import parse_policy
    from specops.policies.retarget import retarget_policy
    from specops.policies.redis_backend import close, connect
    from specops.policies.store import PolicyStore

    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    def policy_text(path: str | Path) -> str:
        text = fast_policy_text(path, time_factor)
        return text if methods is None else retarget_policy(text, methods)[0]

    text = policy_text(policy_path)
    (state_dir / "policy.yaml").write_text(text)
    client = connect(None, state_dir / "redis")
    redis_url = f"unix://{client.socket_file}"
    namespace = f"demo-{int(time.time())}"

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = controller = None
    try:
        store = PolicyStore(client, namespace=namespace)
        machine.start_rollout(store, parse_policy(text, "policy.yaml"), text, actor="demo")
        server = _spawn(["serve", "--port", str(port), "--redis", redis_url, "--namespace", namespace,
                         "--policy", str(state_dir / "policy.yaml"), "--reconcile-s", "1", "--max-batch", "8",
                         "--log-level", "warning", *(["--model", model] if model is not None else [])],
                        state_dir / "serve.log")
        controller = _spawn(["controller", "run", "--redis", redis_url, "--namespace", namespace,
                             "--interval", str(tick_s), "--window", str(max(6.0, 6 * tick_s)),
                             "--listen", f"127.0.0.1:{free_port()}"], state_dir / "controller.log",
                            env={"SPECOPS_WEBHOOK_TOKEN": secrets.token_hex(16)})
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"specops serve exited ({server.returncode}); see {state_dir / 'serve.log'}")
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("specops serve not ready after 600 s")
            time.sleep(0.5)
        if on_event is not None:
            on_event(f"specops serve pid {server.pid} on {url}, specops controller run pid {controller.pid} "
                     f"(tick {tick_s:g}s), Redis {redis_url}")
        traffic = chat_demo_traffic(per_kind) if chat else demo_traffic(seed, per_kind)
        served_name = "bundled" if model is None else Path(model).name  # the name `specops serve` gives it
        seen = {e["id"] for e in store.read_audit(1000)}
        reports: list[HttpRound] = []
        with httpx.Client(timeout=300) as http, ThreadPoolExecutor(len(traffic)) as pool:
            for index in range(rounds):
                if canary_policy_path is not None and index == canary_round:
                    canary_text = policy_text(canary_policy_path)
                    state = machine.start_rollout(store, parse_policy(canary_text, Path(canary_policy_path).name),
                                                  canary_text, actor="demo")
                    if on_event is not None:
                        on_event(f"rolling out {Path(canary_policy_path).name} as revision {state.revision}: "
                                 f"{state.message}")
                    wait_until = time.monotonic() + 15  # the server re-reads the rollout state within 1 s
                    while time.monotonic() < wait_until:
                        seen_canary = httpx.get(f"{url}/readyz", timeout=10).json()["policy"].get("canary")
                        if seen_canary and seen_canary.get("revision") == state.revision:
                            break
                        time.sleep(0.2)

                def run_stream(stream: Traffic) -> list[dict[str, Any]]:
                    out = []
                    for i, prompt in enumerate(stream.prompts):
                        body = {"model": served_name, "max_tokens": max_new_tokens,
                                "temperature": stream.temperature, "seed": seed + 1000 * index + i,
                                "metadata": stream.labels, "user": f"{stream.name}-{index}-{i}"}
                        if chat:
                            body["messages"] = [{"role": "user", "content": prompt}]
                        else:
                            body["prompt"] = prompt
                        started = time.perf_counter()
                        r = http.post(f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body)
                        out.append({"status": r.status_code, "seconds": time.perf_counter() - started,
                                    **(r.json() if r.status_code == 200 else {})})
                    return out

                responses = [r for rs in pool.map(run_stream, traffic) for r in rs]
                time.sleep(tick_s * 1.5)  # at least one controller tick over this round's telemetry
                served: dict[str, dict[str, Any]] = {}
                for r in responses:
                    if r["status"] != 200:
                        continue
                    spec = r["specops"]
                    row = served.setdefault(spec["request_class"], {"requests": 0, "methods": set(), "drafted": 0,
                                                                    "accepted": 0, "tokens": 0, "seconds": 0.0,
                                                                    "canary": 0, "canary_methods": set()})
                    row["requests"] += 1
                    row["methods"].add(spec["method"] + ("(probe)" if spec.get("probe") else ""))
                    row["drafted"] += spec.get("drafted") or 0
                    row["accepted"] += spec.get("accepted") or 0
                    row["tokens"] += r["usage"]["completion_tokens"]
                    row["seconds"] += r["seconds"]
                    if spec.get("canary"):
                        row["canary"] += 1
                        row["canary_methods"].add(spec["method"])
                events = [e for e in store.read_audit(1000) if e["id"] not in seen and e.get("actor") == "controller"]
                seen |= {e["id"] for e in events}
                settings = {name: {"method": s.method, "gamma": s.gamma, "heads": s.medusa_heads,
                                   "fallback": s.fallback_active} for name, s in sorted(store.effective().items())}
                state = store.rollout_state()
                rollout = (f"rev {state.revision} {state.phase} {state.weight}%"
                           if state is not None and state.stable_revision else "")
                report = HttpRound(index, served, settings, events, rollout,
                                   errors=sum(1 for r in responses if r["status"] != 200))
                reports.append(report)
                if on_round is not None:
                    on_round(report)
        return reports
    finally:
        if controller is not None:
            _stop_process(controller)
        if server is not None:
            _stop_process(server)
        client.connection_pool.disconnect()  # our idle pooled connections would count as other users
        close(client)


def format_http_round(report: HttpRound) -> str:
    """One HTTP round as a few aligned lines."""
    lines = [f"round {report.index + 1}" + (f"   [canary: {report.rollout}]" if report.rollout else "")
             + (f"   {report.errors} failed requests" if report.errors else "")]
    for name, row in sorted(report.served.items()):
        acc = f"{row['accepted'] / row['drafted']:.2f}" if row["drafted"] else "  - "
        tps = row["tokens"] / row["seconds"] if row["seconds"] > 0 else 0.0
        s = report.settings.get(name, {})
        knob = f"heads={s.get('heads')}" if s.get("method") == "medusa" else f"gamma={s.get('gamma')}"
        state = "FALLBACK" if s.get("fallback") else s.get("method", "?")
        canary = f" ({row['canary']} canary)" if row["canary"] else ""
        lines.append(f"  {name:<9} {row['requests']:>2} req{canary:<12} ran {','.join(sorted(row['methods'])):<18} "
                     f"accept {acc}  {tps:7.1f} tok/s   -> {state:<8} {knob}")
    for e in report.events:
        what = e.get("reason") or e.get("outcome") or e.get("message") or ""
        lines.append(f"  * {e['kind']}: {str(what)[:150]}")
    return "\n".join(lines)
