"""Prometheus unreachable during a canary analysis of a real ``specops controller run``.

A real Prometheus scrapes ``specops serve`` (steady load) and labels it
``track="canary"``; one controller replica (own namespace, ``--prometheus``,
``--canary-match track="canary"``) analyses a canary rollout whose only analysis rule
passes whenever the canary served anything (tokens/s >= 0), so every run with data
is Successful. Each outage starts right after a Successful run early in a step and lasts
past that step's pause:

* ``kill``: Prometheus SIGKILLed (connection refused), restarted on its data later;
* ``stop``: Prometheus SIGSTOPped (a hung provider: every query times out), then SIGCONT.

A *long* outage lasts until the rollout has paused (``consecutive_error_limit`` + 1
unreachable runs); the operator then promotes (resumes) it. A *short* one ends after
fewer runs and the rollout must go on by itself. Figures, read from the audit stream
(its entry ids carry Redis's clock): analysis runs recorded during the outages (from 0.3 s
after each began: a run whose query finished just before is not the outage's) and how
many were Inconclusive-unreachable, rollbacks (``rollout.degraded`` /
``rollout.rollback``) over the whole scenario, steps promoted during an outage, pauses
that said why, and outages after which the rollout carried on.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time

import httpx

from specops.chaos.leader_kill import is_leader
from specops.chaos.procs import ChaosSetupError, Proc, free_port, specops_argv, specops_env, start, wait_until
from specops.chaos.result import ScenarioResult
from specops.chaos.rig import POLICY, Rig

NAME = "Prometheus unreachable during analysis"
NAMESPACE = "chaos-prom"
ERROR_LIMIT = 4  # consecutive_error_limit: the 5th unreachable run in a row pauses
PAUSE_S = 1.0  # each step's pause: shorter than any outage, so only the hold keeps the step
GRACE_S = 0.3
RULE = "canary-served"


def canary_text(steps: int) -> str:
    """The default policy plus an always-passing analysis rule on ``general``, ``steps`` analysed steps."""
    text = POLICY.read_text()
    head = text[:text.index("\nrollout:")].replace('version: "', 'version: "chaos-prom-', 1)
    rule = (f'  - {{name: {RULE}, metric: tokens_per_s, op: "<", threshold: 0.0, min_samples: 0, action: notify, '
            "classes: [general]}\n")
    weights = [max(1, round(99 * (i + 1) / (steps + 1))) for i in range(steps)]
    body = "\n".join(f"    - {{weight: {w}, pause_s: {PAUSE_S}, analysis: true}}" for w in weights)
    return (f"{head}\n{rule}rollout:\n  steps:\n{body}\n  analysis: {{interval_s: 0.25, window_s: 10, failure_limit: 0, "
            f"inconclusive_limit: 1000, consecutive_error_limit: {ERROR_LIMIT}, rules: [{RULE}]}}\n")


class Prometheus:
    """One Prometheus on a fixed loopback port and data directory, so a restart is the same server."""

    def __init__(self, rig: Rig, target_port: int) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise ChaosSetupError("prometheus not found (install prometheus)")
        self.workdir = rig.workdir / "prometheus"
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text("global: {scrape_interval: 500ms, evaluation_interval: 1s}\nscrape_configs:\n"
                          "  - job_name: specops-canary\n"
                          f"    static_configs: [{{targets: ['127.0.0.1:{target_port}'], labels: {{track: canary}}}}]\n")
        self.port = free_port()
        self.argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = start("prometheus", self.argv, self.workdir, self.port, timeout_s=60)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def _at(event: dict) -> float:
    """Redis's time (s) of an audit entry, from its stream id."""
    return int(str(event["id"]).split("-")[0]) / 1000


def _redis_now(client) -> float:
    sec, usec = client.time()
    return sec + usec / 1e6


def _ready_for_outage(state, now: float) -> bool:
    """A successful run at a step whose pause is still running: with Prometheus up it would advance
    within the pause, so only the hold can keep it there. (A step already past its pause may advance
    in the very tick of its success, before an outage begun now could matter: skip to the next.)"""
    return (state is not None and state.phase == "progressing" and now - state.step_started_at < 0.8 * PAUSE_S
            and any(r.get("outcome") == "successful" for r in state.current_runs()))


def _unreachable_since(state, since: float) -> int:
    return sum(1 for r in state.current_runs() if r.get("unreachable") and r.get("at", 0) > since)


def run(rig: Rig, *, outages: list[tuple[str, bool]]) -> ScenarioResult:
    """``outages``: (``kill`` | ``stop``, long?) in order."""
    import redis

    from specops.policies import rollout as machine
    from specops.policies.loader import parse_policy
    from specops.policies.store import PolicyStore

    rig.ensure_serve()
    client = redis.Redis(host="127.0.0.1", port=rig.redis_port, socket_timeout=10)
    store = PolicyStore(client, namespace=NAMESPACE)
    prom = Prometheus(rig, rig.serve.port)
    controller: Proc | None = None
    stop = threading.Event()
    served = [0]

    def load() -> None:  # steady canary traffic, so every window has data while Prometheus is up
        with httpx.Client(timeout=60, headers=rig.auth) as c:
            while not stop.is_set():
                try:
                    r = c.post(f"{rig.serve.url}/v1/completions",
                               json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
                    served[0] += r.status_code == 200
                except httpx.HTTPError:
                    pass
                stop.wait(0.3)

    loader = threading.Thread(target=load, daemon=True)
    windows: list[tuple[float, float]] = []
    paused_with_reason = carried_on = held_past_pause = 0
    try:
        prom.start()
        loader.start()
        port = free_port()
        argv = specops_argv("controller", "run", "--policy", str(POLICY), "--redis", rig.redis_url, "--namespace",
                            NAMESPACE, "--interval", "0.5", "--window", "10", "--prometheus", prom.url,
                            "--canary-match", 'track="canary"', "--listen", f"127.0.0.1:{port}", "--log-level", "info")
        controller = start("controller-prom", argv, rig.workdir / NAMESPACE, port,
                           env=specops_env(SPECOPS_WEBHOOK_TOKEN=rig.webhook_token), timeout_s=60)
        wait_until(lambda: is_leader(controller), "the controller to lead", 30)
        text = canary_text(steps=4 * len(outages) + 4)  # room for steps passed over
        machine.start_rollout(store, parse_policy(text, "<chaos prom canary>"), text, actor="chaos")
        for i, (how, long) in enumerate(outages):
            wait_until(lambda: _ready_for_outage(store.rollout_state(), _redis_now(client)),
                       f"a successful analysis run early in a step before outage {i + 1}", 90, every_s=0.02)
            before = store.rollout_state()
            began = _redis_now(client)
            if how == "kill":
                prom.proc.kill()
            else:
                prom.proc.signal(signal.SIGSTOP)
            try:
                if long:
                    wait_until(lambda: store.rollout_state().phase != "progressing", "the rollout to pause", 120)
                    state = store.rollout_state()
                    paused_with_reason += state.phase == "paused" and "unreachable" in state.message
                else:  # a few unreachable runs (one for a hung Prometheus: each waits out its timeouts), past the pause
                    wanted = 1 if how == "stop" else 2
                    wait_until(lambda: _unreachable_since(store.rollout_state(), began) >= wanted
                               and _redis_now(client) - before.step_started_at > PAUSE_S + 0.3,
                               f"{wanted} unreachable run(s) past the step's pause", 120, every_s=0.02)
                held_past_pause += _redis_now(client) - before.step_started_at > PAUSE_S \
                    and store.rollout_state().step_index == before.step_index
            finally:
                ended = _redis_now(client)
                windows.append((began, ended))
                if how == "kill":
                    prom.start()
                else:
                    prom.proc.signal(signal.SIGCONT)
            if store.rollout_state().phase == "paused":
                machine.promote(store, actor="chaos-operator", reason="Prometheus is back")
            try:
                wait_until(lambda: store.rollout_state().step_index > before.step_index, "the rollout to carry on", 90)
                carried_on += 1
            except TimeoutError:
                pass
        events = store.read_audit(count=10_000)
    finally:
        stop.set()
        if loader.is_alive():
            loader.join(70)
        if controller is not None:
            controller.stop()
        prom.stop()
        client.close()

    def during(e: dict) -> bool:
        return any(b + GRACE_S < _at(e) <= end for b, end in windows)

    runs = [e for e in events if e.get("kind") == "rollout.analysis" and during(e)]
    inconclusive = [e for e in runs if e.get("outcome") == "inconclusive" and e.get("unreachable")]
    rollbacks = [e for e in events if e.get("kind") in ("rollout.degraded", "rollout.rollback")]
    promoted = [e for e in events if e.get("kind") in ("rollout.step", "rollout.complete") and during(e)]
    longs = sum(long for _, long in outages)
    figures = {"outages": len(outages), "outage_kinds": ",".join(f"{h}-{'long' if lg else 'short'}" for h, lg in outages),
               "analysis_runs_during_outage": len(runs), "marked_inconclusive": len(inconclusive),
               "false_rollbacks": len(rollbacks), "steps_promoted_during_outage": len(promoted),
               "held_past_step_pause": f"{held_past_pause}/{len(outages)}",
               "paused_saying_why": f"{paused_with_reason}/{longs}",
               "carried_on_after_return": f"{carried_on}/{len(outages)}", "requests_served": served[0]}
    met = (len(runs) > 0 and len(inconclusive) == len(runs) and not rollbacks and not promoted
           and paused_with_reason == longs and carried_on == len(outages) and held_past_pause == len(outages))
    return ScenarioResult(NAME, figures, "all runs during the outage inconclusive, 0 false rollbacks, 0 steps promoted; "
                          "long outages pause saying why; the rollout carries on after", met)
