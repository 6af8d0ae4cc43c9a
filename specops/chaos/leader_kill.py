"""The leading ``specops controller run`` SIGKILLed N times mid-rollout, two replicas running.

A canary rollout with many short steps (no analysis, so it advances on time alone)
is started; each time the leader has advanced a step it is SIGKILLed (it cannot
release its lease), the standby must take the lease and carry the rollout on, and a
fresh replica is started so two run again. Figures: rollouts resumed (a step applied
by the new leader after the kill), time from the kill to the standby leading, steps
applied twice (two ``rollout.step`` audit records for the same step), and audit
records written under an older epoch after a newer one (split-brain writes).
"""

from __future__ import annotations

import re
import time
import urllib.request

from specops.chaos.procs import Proc, free_port, specops_argv, specops_env, start, wait_until
from specops.chaos.result import ScenarioResult
from specops.chaos.rig import POLICY, Rig

NAME = "leading controller SIGKILLed mid-rollout"
NAMESPACE = "chaos-leader"
TTL_MS = 1000
INTERVAL_S = 0.2
STEP_PAUSE_S = 1.0


def is_leader(proc: Proc) -> bool | None:
    """The controller's own view from its /metrics (None while unreachable)."""
    try:
        body = urllib.request.urlopen(f"{proc.url}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    for line in body.splitlines():
        if line.startswith("specops_controller_is_leader "):
            return float(line.split()[1]) == 1.0
    return None


def canary_policy(steps: int) -> tuple[str, object]:
    """The default policy with ``steps`` short canary steps, parsed and as YAML text."""
    from specops.policies.loader import parse_policy

    text = POLICY.read_text()
    head = text[:text.index("\nrollout:")]
    weights = [max(1, round(100 * (i + 1) / (steps + 1))) for i in range(steps)]
    body = "\n".join(f"    - {{weight: {w}, pause_s: {STEP_PAUSE_S}, analysis: false}}" for w in weights)
    text = re.sub(r'^version: .*$', 'version: "chaos-canary"', head, count=1, flags=re.M)
    text += f"\nrollout:\n  steps:\n{body}\n"
    return text, parse_policy(text, "<chaos canary>")


def start_replica(rig: Rig, i: int, ns: str = NAMESPACE, ttl_ms: int = TTL_MS) -> Proc:
    port = free_port()
    argv = specops_argv("controller", "run", "--policy", str(POLICY), "--redis", rig.redis_url, "--namespace", ns,
                        "--interval", str(INTERVAL_S), "--lease-ttl-ms", str(ttl_ms), "--listen", f"127.0.0.1:{port}",
                        "--log-level", "info")
    return start(f"controller-{ns}-{i}", argv, rig.workdir / ns, port,
                 env=specops_env(SPECOPS_WEBHOOK_TOKEN=rig.webhook_token), timeout_s=60)


def audit_findings(store, kinds=("rollout.step", "rollout.complete")) -> tuple[int, int, list[dict]]:
    """(steps applied twice, records under an epoch older than one already written, the step records)."""
    events = store.read_audit(count=10_000)
    seen, twice, stale, top = set(), 0, 0, -1
    steps = []
    for e in events:
        epoch = e.get("epoch")
        if isinstance(epoch, int):
            if epoch < top:
                stale += 1
            top = max(top, epoch)
        if e.get("kind") in kinds:
            key = (e.get("revision"), e.get("to_step", "complete"))
            steps.append(e)
            if key in seen:
                twice += 1
            seen.add(key)
    return twice, stale, steps


def run(rig: Rig, *, kills: int) -> ScenarioResult:
    import redis

    from specops.policies import rollout as machine
    from specops.policies.store import PolicyStore

    rig.ensure_redis()
    client = redis.Redis(host="127.0.0.1", port=rig.redis_port, socket_timeout=5)
    store = PolicyStore(client, namespace=NAMESPACE)
    replicas: list[Proc] = []
    started = 0
    resumed, takeovers = 0, []
    try:
        for _ in range(2):  # one at a time: both would race to bootstrap the --policy revision
            replicas.append(start_replica(rig, started))
            started += 1
        wait_until(lambda: [is_leader(p) for p in replicas].count(True) == 1, "exactly one leader", 30)
        # each cycle uses up several steps (a fresh replica starts meanwhile); weights stay strictly increasing
        text, policy = canary_policy(steps=min(98, 6 * kills + 6))
        rev = machine.start_rollout(store, policy, text, actor="chaos").revision
        for _ in range(kills):
            leader = next(p for p in replicas if is_leader(p))
            standby = next(p for p in replicas if p is not leader)
            before = store.rollout_state().step_index
            wait_until(lambda: store.rollout_state().step_index > before, "the leader to apply a step", 30)
            at_kill = store.rollout_state().step_index
            leader.kill()  # SIGKILL: the lease is not released, it has to expire
            killed_at = time.monotonic()
            replicas.remove(leader)
            wait_until(lambda: is_leader(standby), "the standby to lead", 30, every_s=0.02)
            takeovers.append(time.monotonic() - killed_at)
            wait_until(lambda: store.rollout_state().step_index > at_kill or store.rollout_state().phase != "progressing",
                       "the new leader to carry the rollout on", 30)
            if store.rollout_state().phase in ("progressing", "healthy"):
                resumed += 1
            replicas.append(start_replica(rig, started))
            started += 1
        final = store.rollout_state()
        twice, stale, steps = audit_findings(store)
        max_takeover = max(takeovers) if takeovers else None
        figures = {"kills": kills, "rollouts_resumed": f"{resumed}/{kills}",
                   "takeover_s_max": round(max_takeover, 2) if max_takeover is not None else None,
                   "lease_ttl_s": TTL_MS / 1000, "steps_recorded": len(steps), "steps_applied_twice": twice,
                   "stale_epoch_writes": stale, "revision": rev, "final_step": final.step_index,
                   "final_phase": final.phase}
        # time to resume: a killed leader's lease lives up to one TTL after its last renewal; the
        # standby tries every tenth of the lease's validity; 0.25 s of scheduling slack on 2 busy cores
        bound = TTL_MS / 1000 * 1.1 + 0.25
        figures["takeover_bound_s"] = round(bound, 2)
        met = (resumed == kills and twice == 0 and stale == 0 and max_takeover is not None
               and max_takeover <= bound)
        return ScenarioResult(NAME, figures, f"{kills}/{kills} resumed, takeover ≤ TTL + TTL/10 + 0.25 s, "
                                             "0 twice, 0 stale", met)
    finally:
        for p in replicas:
            p.stop()
        client.close()
