"""Redis paused (SIGSTOP) for longer than the leader lease while two controllers run a rollout.

While Redis is stopped both replicas block or time out; when it continues the
leader's lease has expired, so whichever replica acquires next leads — and a write
the old leader sends with its old fence must be refused. Figures: pauses, writes
accepted under an epoch older than one already written (read back from the audit
stream, which records the writer's epoch), canary steps applied twice, and whether
exactly one replica leads afterwards.
"""

from __future__ import annotations

import signal
import time

from specops.chaos.leader_kill import TTL_MS, audit_findings, canary_policy, is_leader, start_replica
from specops.chaos.procs import wait_until
from specops.chaos.result import ScenarioResult
from specops.chaos.rig import Rig

NAME = "Redis paused longer than the lease"
NAMESPACE = "chaos-pause"


def run(rig: Rig, *, pauses: int, pause_s: float) -> ScenarioResult:
    import redis

    from specops.policies import rollout as machine
    from specops.policies.store import PolicyStore

    if pause_s * 1000 <= TTL_MS:
        raise ValueError(f"pause_s ({pause_s}) must exceed the lease TTL ({TTL_MS} ms)")
    rig.ensure_redis()
    client = redis.Redis(host="127.0.0.1", port=rig.redis_port, socket_timeout=10)
    store = PolicyStore(client, namespace=NAMESPACE)
    replicas = []
    one_leader_after = 0
    try:
        for i in range(2):
            replicas.append(start_replica(rig, i, ns=NAMESPACE))
        wait_until(lambda: [is_leader(p) for p in replicas].count(True) == 1, "exactly one leader", 30)
        text, policy = canary_policy(steps=min(98, 6 * pauses + 6))
        machine.start_rollout(store, policy, text, actor="chaos")
        for _ in range(pauses):
            before = store.rollout_state().step_index
            wait_until(lambda: store.rollout_state().step_index > before, "a step applied before the pause", 30)
            rig.redis.signal(signal.SIGSTOP)
            try:
                time.sleep(pause_s)
            finally:
                rig.redis.signal(signal.SIGCONT)
            wait_until(lambda: [is_leader(p) for p in replicas].count(True) == 1, "one leader after the pause", 30)
            after = store.rollout_state().step_index
            wait_until(lambda: store.rollout_state().step_index > after or store.rollout_state().phase != "progressing",
                       "the rollout to go on after the pause", 30)
            views = [is_leader(p) for p in replicas]
            one_leader_after += int(views.count(True) == 1)
        twice, stale, steps = audit_findings(store)
        alive = sum(p.alive() for p in replicas)
        figures = {"pauses": pauses, "pause_s": pause_s, "lease_ttl_s": TTL_MS / 1000,
                   "stale_leader_writes_accepted": stale, "steps_applied_twice": twice,
                   "one_leader_after_pause": f"{one_leader_after}/{pauses}", "steps_recorded": len(steps),
                   "replicas_alive": alive}
        met = stale == 0 and twice == 0 and one_leader_after == pauses and alive == 2
        return ScenarioResult(NAME, figures, "0 split-brain writes, 0 steps twice, one leader after each pause", met)
    finally:
        rig.redis.signal(signal.SIGCONT)
        for p in replicas:
            p.stop()
        client.close()
