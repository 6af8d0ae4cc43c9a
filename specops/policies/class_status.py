"""Per-class status for ``specops policy status``: settings, fallback, last decision, live window.

For every class of the current policy (and any class the store still has settings
for) a :class:`ClassStatus` joins three sources:

* the effective settings the controller keeps in Redis (method, γ, heads, tree size,
  fallback flag, probe share) — the policy's initial values when the controller has
  not written any yet;
* the audit stream, newest first, for the class's last decision (when, what, why)
  and, while fallen back, the decision that turned speculation off (since, why);
* the bucketed telemetry counters for the live window (acceptance, speed-up,
  tokens/s), read the same way the controller reads them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from specops.policies.audit_log import change_text, expand, read_entries, when
from specops.policies.rollout import effective_for
from specops.policies.state import EffectiveSettings, RolloutState
from specops.policies.store import PolicyStore
from specops.telemetry.records import GAMMA_METHODS
from specops.telemetry.redis_metrics import RedisWindowReader

#: decision kinds that say something about one class (holds are never written)
CLASS_KINDS = ("adapt", "fallback_on", "fallback_off", "seed", "alert.notify", "set")


@dataclass(frozen=True)
class LastDecision:
    """The newest audit record about a class."""

    at: float
    kind: str
    reason: str
    change: str
    """``gamma 4 -> 5``; empty when nothing changed (an alert notification)."""
    revision: int | None
    epoch: int | None


@dataclass(frozen=True)
class LiveWindow:
    """The class's traffic over the last ``window_s`` seconds (all pods)."""

    window_s: float
    requests: int
    acceptance_rate: float | None
    """None when nothing was drafted (plain decoding only)."""
    speedup: float | None
    tokens_per_s: float | None


@dataclass(frozen=True)
class ClassStatus:
    """What one request class runs now, and why."""

    name: str
    method: str
    gamma: int
    medusa_heads: int
    tree_size: int
    fallback_active: bool
    fallback_since: float | None
    fallback_reason: str | None
    probe_fraction: float
    revision: int | None
    updated_at: float | None
    controlled: bool
    """False when the controller has written no settings yet (policy initial values shown)."""
    last_decision: LastDecision | None
    live: LiveWindow | None
    """None when the class had no requests in the window."""
    eagle_topk: int | None = None
    """An eagle class's EAGLE-2 tree (the policy's ``eagle_topk``; None: it drafts chains)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _live(stats: Any, window_s: float) -> LiveWindow | None:
    if stats is None or stats.requests <= 0:
        return None
    return LiveWindow(window_s=window_s, requests=stats.requests,
                      acceptance_rate=stats.acceptance_rate if stats.drafted else None,
                      speedup=stats.speedup if stats.wall_s > 0 else None,
                      tokens_per_s=stats.tokens_per_s if stats.wall_s > 0 else None)


def class_statuses(store: PolicyStore, *, window_s: float = 60.0, audit_scan: int = 500,
                   clock: Any = time.time, telemetry_namespace: str | None = None) -> dict[str, ClassStatus]:
    """Status of every class, keyed by class name (policy order first, then any leftovers)."""
    policy = store.current_policy()
    revision = store.current_revision()
    effective = store.effective()
    names = list(policy.class_names) if policy is not None else []
    names += [n for n in effective if n not in names]
    if not names:
        return {}
    defaults: dict[str, EffectiveSettings] = effective_for(policy, revision or 0, clock()) if policy else {}
    last: dict[str, LastDecision] = {}
    fell_back: dict[str, tuple[float, str]] = {}
    for entry in reversed(read_entries(store, count=audit_scan)):  # newest first
        for rec in expand(entry):
            name = rec.request_class
            if name is None or rec.kind not in CLASS_KINDS:
                continue
            if name not in last:
                last[name] = LastDecision(rec.at, rec.kind, rec.reason, change_text(rec.before, rec.after),
                                          rec.revision, rec.epoch)
            if rec.kind == "fallback_on" and name not in fell_back:
                fell_back[name] = (rec.at, rec.reason)
        if len(last) == len(names) and len(fell_back) == len(names):
            break
    reader = RedisWindowReader(store.redis, namespace=telemetry_namespace or store.namespace, clock=clock)
    windows = reader.windows(names, window_s)
    out: dict[str, ClassStatus] = {}
    for name in names:
        s = effective.get(name) or defaults.get(name)
        if s is None:
            continue
        since, why = (None, None)
        if s.fallback_active:
            since, why = fell_back.get(name, (s.updated_at, "fallen back (no decision in the scanned audit)"))
        out[name] = ClassStatus(
            name=name, method=s.method, gamma=s.gamma, medusa_heads=s.medusa_heads, tree_size=s.tree_size,
            fallback_active=s.fallback_active, fallback_since=since, fallback_reason=why,
            probe_fraction=s.probe_fraction, revision=s.revision, updated_at=s.updated_at if name in effective else None,
            controlled=name in effective, last_decision=last.get(name), live=_live(windows.get(name), window_s),
            eagle_topk=eagle_topk(policy, name))
    return out


def eagle_topk(policy: Any, name: str) -> int | None:
    """The ``eagle_topk`` of ``policy``'s class ``name`` (None: no policy, no such class, or chains)."""
    if policy is None or name not in policy.class_names:
        return None
    return policy.get_class(name).eagle_topk


def _knob(c: ClassStatus) -> str:
    if c.method == "medusa":
        return f"heads {c.medusa_heads} tree {c.tree_size}"
    if c.method == "eagle" and c.eagle_topk is not None:
        return f"γ {c.gamma} tree {c.tree_size} top-{c.eagle_topk}"
    if c.method in GAMMA_METHODS:
        return f"γ {c.gamma}"
    return "-"


def _age(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    s = max(0.0, now - ts)
    if s < 120:
        return f"{s:.0f}s ago"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.1f}h ago"


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def status_table(classes: dict[str, ClassStatus], now: float, window_s: float, width: int = 160) -> str:
    """A terminal table, one row per class, plus a line per class that is fallen back or has a last decision."""
    header = (f"{'CLASS':<12} {'METHOD':<7} {'KNOBS':<17} {'FALLBACK':<22} {'ACCEPT':>6} {'SPEEDUP':>7} "
              f"{'TOK/S':>8} {'REQS':>5}  LAST DECISION")
    rows = [header]
    for c in classes.values():
        if c.fallback_active:
            fb = f"on {_age(c.fallback_since, now)} p={c.probe_fraction:.0%}"
        else:
            fb = "off"
        live = c.live
        acc = _fmt(live.acceptance_rate if live else None, ".2f")
        spd = _fmt(live.speedup if live else None, ".2f")
        tps = _fmt(live.tokens_per_s if live else None, ".1f")
        reqs = str(live.requests) if live else "0"
        d = c.last_decision
        last = f"{d.kind} {_age(d.at, now)}" + (f": {d.change}" if d.change else "") if d else \
            ("-" if c.controlled else "(no controller yet: policy initial values)")
        row = (f"{_short(c.name, 12):<12} {c.method:<7} {_knob(c):<17} {fb:<22} {acc:>6} {spd:>7} {tps:>8} "
               f"{reqs:>5}  {last}")
        rows.append(_short(row, width))
    notes = []
    for c in classes.values():
        if c.fallback_active:
            notes.append(f"  {c.name}: fallen back since {when(c.fallback_since) if c.fallback_since else '?'}: "
                         f"{c.fallback_reason}")
        repeats_fallback = c.fallback_active and c.last_decision and c.last_decision.kind == "fallback_on"
        if c.last_decision and c.last_decision.reason and not repeats_fallback:
            d = c.last_decision
            notes.append(f"  {c.name}: last decision {d.kind} at {when(d.at)} (rev {d.revision}, epoch {d.epoch}): "
                         f"{d.reason}")
    footer = [f"live figures: the last {window_s:g}s of telemetry (all pods)"]
    return "\n".join(rows + ([""] + [_short(n, width) for n in notes] if notes else []) + footer)


def status_document(state: RolloutState, classes: dict[str, ClassStatus]) -> dict[str, Any]:
    """The ``--json`` object: the rollout state's fields plus ``classes`` keyed by class name."""
    return {**json.loads(state.to_json()), "generation": state.generation,
            "classes": {name: c.as_dict() for name, c in classes.items()}}
