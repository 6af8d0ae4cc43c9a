"""``specops policy rollout FILE --dry-run``: what a policy would do, against live metrics.

Nothing is written. For each class of the new policy it shows the settings it
would apply next to the ones in effect, and evaluates the policy's alert rules on
the fleet's live metric window (read from the Redis buckets the runtimes publish,
judged with the controller's own rule evaluation), so an operator sees which
alerts would fire — and which rollout steps would follow.
"""

from __future__ import annotations

import logging

import redis

from specops.controller.fallback import judge
from specops.controller.sources import RedisWindowSource
from specops.policies.class_status import eagle_topk
from specops.policies.rollout import effective_for
from specops.policies.schema import Policy
from specops.policies.state import EffectiveSettings
from specops.policies.store import PolicyStore
from specops.telemetry.redis_metrics import RedisWindowReader

log = logging.getLogger(__name__)


def _knobs(s: EffectiveSettings | None, topk: int | None = None) -> str:
    """One class's settings; ``topk``: the class's ``eagle_topk`` (an eagle class drafting EAGLE-2 trees)."""
    if s is None:
        return "-"
    if s.method == "off" or s.fallback_active:
        return f"{s.method}{' (fallback)' if s.fallback_active else ''}"
    if s.method == "medusa":
        return f"medusa heads={s.medusa_heads} tree={s.tree_size}"
    if s.method == "eagle" and topk is not None:
        return f"eagle gamma={s.gamma} tree={s.tree_size} topk={topk}"
    return f"{s.method} gamma={s.gamma}"


def dry_run(store: PolicyStore, policy: Policy, window_s: float) -> str:
    """A readable report of what rolling out ``policy`` would do now (changes nothing)."""
    now = store.clock()
    current_rev = store.current_revision()
    current = store.effective()
    proposed = effective_for(policy, 0, now, current)
    out = [f"dry run: policy version {policy.version} (current revision: {current_rev if current_rev else 'none'})"]
    out.append(f"{'CLASS':<16} {'NOW':<32} WOULD APPLY")
    live_policy = store.current_policy()
    for name, s in proposed.items():
        out.append(f"{name:<16} {_knobs(current.get(name), eagle_topk(live_policy, name)):<32} "
                   f"{_knobs(s, eagle_topk(policy, name))}")
    for name in sorted(set(current) - set(proposed)):
        out.append(f"{name:<16} {_knobs(current[name], eagle_topk(live_policy, name)):<32} "
                   f"(class removed: default class {policy.default_class})")

    source = RedisWindowSource(RedisWindowReader(store.redis, clock=store.clock, namespace=store.namespace))
    try:
        readings = source.read_many(policy.class_names, window_s)
    except redis.RedisError as exc:  # the source maps its own errors; this is belt and braces
        readings = {}
        log.warning("metrics unavailable for dry run: %s", exc)
    out.append(f"alerts on the live {window_s:g}s window:")
    if not policy.alerts:
        out.append("  (policy has no alert rules)")
    for rule in policy.alerts:
        for name in policy.class_names:
            if not rule.applies_to(name):
                continue
            reading = readings.get(name)
            stats = reading.stats if reading is not None else None
            outcome = judge(rule, name, stats)
            verdict = {"violated": f"WOULD FIRE -> {rule.action}", "ok": "ok"}.get(outcome.outcome, "inconclusive")
            out.append(f"  {rule.name:<20} {name:<16} {verdict:<24} {outcome.reason}")
    steps = ", ".join(f"{s.weight}%" + (f" for {s.pause_s:g}s" if s.pause_s is not None else " until promote")
                      for s in policy.rollout.steps)
    if current_rev is None:
        out.append("rollout: first revision, would become current at once")
    else:
        out.append(f"rollout: canary steps {steps}; then current")
    out.append("nothing was applied (--dry-run)")
    return "\n".join(out)
