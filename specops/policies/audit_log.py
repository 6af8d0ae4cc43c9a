"""The audit stream as a readable decision log (``specops policy decisions``).

The store appends one stream entry per write (``PolicyStore.commit``): new revisions,
rollout steps and analysis runs, rollbacks, and the controller's effective-settings
writes, which carry per class the decision's kind (``adapt``, ``fallback_on``,
``fallback_off``, ``seed``), its reason and its inputs (the metric window, the goodput
estimates compared, the dead-band, the alert rules' values against their thresholds).

:func:`read_entries` reads the raw stream (by time or after an entry id);
:func:`expand` turns one entry into :class:`LogRecord` s — one per class for a
settings write — each with the policy revision and the leader epoch that made it;
:func:`format_record` renders one record as a few lines of text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import redis

from specops.policies.errors import StoreUnavailableError
from specops.policies.store import PolicyStore

#: knobs shown in a decision's change line, in this order
KNOBS = ("method", "gamma", "medusa_heads", "tree_size", "fallback_active")


@dataclass(frozen=True)
class AuditEntry:
    """One raw entry of the audit stream."""

    id: str
    """Redis stream id (``<ms>-<seq>``); later entries have larger ids."""
    kind: str
    """``effective.set``, ``rollout.analysis``, ``rollout.rollback``, ``alert.notify``, ..."""
    at: float
    """Store clock (unix seconds) when written."""
    actor: str
    """``controller``, ``operator``, ``controller-bootstrap``, ..."""
    epoch: int | None
    """Leader epoch that made the write (None: an operator's write, not fenced)."""
    data: dict[str, Any]
    """Everything else the event carried."""


@dataclass(frozen=True)
class LogRecord:
    """One readable decision: a class's settings change, an alert, a rollout event."""

    id: str
    at: float
    kind: str
    """Decision kind: ``adapt``, ``fallback_on``, ``fallback_off``, ``seed``, ``alert.notify``,
    ``rollout.analysis``, ``rollout.rollback``, ``revision.created``, ..."""
    request_class: str | None
    revision: int | None
    epoch: int | None
    actor: str
    reason: str
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "at": self.at, "kind": self.kind, "class": self.request_class,
                "revision": self.revision, "epoch": self.epoch, "actor": self.actor, "reason": self.reason,
                "before": self.before, "after": self.after, "inputs": self.inputs}


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise StoreUnavailableError(f"Redis unavailable: {exc}", retry_after_s=1.0) from exc


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _entry(entry_id: Any, fields_: dict[Any, Any]) -> AuditEntry:
    fields_ = {_text(k): _text(v) for k, v in fields_.items()}
    try:
        event = json.loads(fields_.get("event", "{}"))
    except json.JSONDecodeError:
        event = {"kind": "unreadable", "raw": fields_.get("event", "")[:200]}
    if not isinstance(event, dict):
        event = {"kind": "unreadable", "raw": str(event)[:200]}
    if "revision" in fields_ and "revision" not in event:
        event["revision"] = int(fields_["revision"])
    epoch = event.pop("epoch", None)
    return AuditEntry(id=_text(entry_id), kind=str(event.pop("kind", "?")), at=float(event.pop("at", 0.0) or 0.0),
                      actor=str(event.pop("actor", "?")), epoch=epoch if isinstance(epoch, int) else None, data=event)


def server_now(store: PolicyStore) -> float:
    """Redis' own clock (stream ids are its milliseconds), unix seconds."""
    seconds, micros = _call(store.redis.time)
    return float(seconds) + float(micros) / 1e6


def read_entries(store: PolicyStore, *, since_s: float | None = None, after_id: str | None = None,
                 count: int = 1000) -> list[AuditEntry]:
    """Entries oldest first: the last ``since_s`` seconds, or those after ``after_id``, at most ``count``
    (the newest ``count`` when more match)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    key = store.keys["audit"]
    low = "-"
    if after_id is not None:
        low = "(" + after_id
    elif since_s is not None:
        if since_s <= 0:
            raise ValueError(f"since must be a positive duration, got {since_s}")
        low = f"{max(0, int((server_now(store) - since_s) * 1000))}-0"
    raw = _call(store.redis.xrevrange, key, max="+", min=low, count=count)
    return [_entry(i, f) for i, f in reversed(raw)]


def follow(store: PolicyStore, after_id: str, *, duration_s: float | None = None,
           block_ms: int = 500) -> Iterator[list[AuditEntry]]:
    """Batches of entries newer than ``after_id`` as they arrive (an empty batch every ``block_ms``
    without news), for ``duration_s`` seconds or until the caller stops iterating."""
    key = store.keys["audit"]
    last = after_id
    deadline = None if duration_s is None else time.monotonic() + duration_s
    while deadline is None or time.monotonic() < deadline:
        wait = block_ms if deadline is None else max(1, min(block_ms, int((deadline - time.monotonic()) * 1000)))
        reply = _call(store.redis.xread, {key: last}, count=500, block=wait)
        batch = [_entry(i, f) for _, entries in (reply or []) for i, f in entries]
        if batch:
            last = batch[-1].id
        yield batch


def last_id(store: PolicyStore) -> str:
    """Id of the newest entry (``0-0`` for an empty stream)."""
    newest = _call(store.redis.xrevrange, store.keys["audit"], count=1)
    return _text(newest[0][0]) if newest else "0-0"


def expand(entry: AuditEntry) -> list[LogRecord]:
    """The readable records in one entry (a settings write holds one per class)."""
    d = entry.data
    base = {"id": entry.id, "at": entry.at, "epoch": entry.epoch, "actor": entry.actor}
    if entry.kind == "effective.set":
        out = []
        settings = d.get("settings") or {}
        inputs_by_class = d.get("inputs") or {}
        for name in d.get("classes") or sorted(settings):
            after = settings.get(name) or {}
            inputs = dict(inputs_by_class.get(name) or {})
            kind = str(inputs.pop("kind", "set"))
            reason = str(inputs.pop("reason", d.get("reason", "")))
            before = inputs.pop("before", {}) or {}
            out.append(LogRecord(kind=kind, request_class=name, revision=after.get("revision"), reason=reason,
                                 before=before, after={k: after[k] for k in KNOBS if k in after}, inputs=inputs,
                                 **base))
        return out
    revision = d.get("revision", d.get("to_revision"))
    reason = str(d.get("reason") or d.get("message") or d.get("why") or "")
    if entry.kind == "rollout.analysis":
        reason = f"{d.get('outcome', '?')}: {d.get('message', '')}"
    inputs = {k: v for k, v in d.items() if k not in ("revision", "reason", "class")}
    return [LogRecord(kind=entry.kind, request_class=d.get("class"), revision=revision if isinstance(revision, int)
                      else None, reason=reason, inputs=inputs, **base)]


def records(entries: list[AuditEntry], request_class: str | None = None) -> list[LogRecord]:
    """All records of ``entries``; with ``request_class``, only that class's (rollout events included)."""
    out = [r for e in entries for r in expand(e)]
    if request_class is None:
        return out
    return [r for r in out if r.request_class in (request_class, None)]


def when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _num(v: Any, fmt: str = ".3g") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _window_line(inputs: dict[str, Any]) -> str | None:
    if "requests" not in inputs:
        return None
    parts = [f"{inputs.get('requests')} requests"]
    for key, label in (("acceptance_rate", "acceptance"), ("speedup", "speed-up"), ("tokens_per_s", "tokens/s")):
        if inputs.get(key) is not None:
            parts.append(f"{label} {_num(inputs[key])}")
    if inputs.get("drafted") is not None:
        parts.append(f"drafted {inputs['drafted']}, accepted {inputs.get('accepted')}")
    return "window: " + ", ".join(parts)


def _estimates_line(inputs: dict[str, Any]) -> str | None:
    est = inputs.get("estimates")
    if not est:
        return None
    shown = "  ".join(f"{k}:{_num(v, '.1f')}" for k, v in sorted(est.items(), key=lambda kv: int(kv[0])))
    extra = []
    if inputs.get("expected_gain") is not None:
        extra.append(f"expected gain {_num(inputs['expected_gain'] * 100, '+.1f')}%")
    if inputs.get("dead_band") is not None:
        extra.append(f"dead-band {_num(inputs['dead_band'] * 100, '.1f')}%")
    label = inputs.get("estimate_unit", "tokens/s")
    return f"estimates ({label} by knob value): {shown}" + (f"; {', '.join(extra)}" if extra else "")


def _rules_lines(rules: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rules or []:
        if not isinstance(r, dict):
            continue
        if "rule" not in r:  # a class whose metric source was unreachable: {"class", "outcome", "reason"}
            lines.append(f"{r.get('class', '?')}: {r.get('outcome', '?')} ({r.get('reason', '')})")
            continue
        value = "n/a" if r.get("value") is None else _num(r["value"], ".4g")
        state = r.get("outcome", "?") + (", firing" if r.get("firing") else "")
        pending = f", pending {_num(r.get('pending_s', 0), '.0f')}s" if r.get("pending_s") else ""
        who = f" on {r['class']}" if r.get("class") else ""
        lines.append(f"rule {r['rule']}{who}: {value} {r.get('op', '?')} {_num(r.get('threshold'))} "
                     f"-> {state}{pending}")
    return lines


def change_text(before: dict[str, Any], after: dict[str, Any]) -> str:
    """``gamma 4 -> 5`` for the knobs that changed (or all of them, for a first setting)."""
    if not before:
        return ", ".join(f"{k}={after[k]}" for k in KNOBS if k in after)
    changed = [f"{k} {before.get(k)} -> {after[k]}" for k in KNOBS if k in after and before.get(k) != after[k]]
    return ", ".join(changed)


def format_record(r: LogRecord) -> str:
    """A few lines: a header (time, revision, epoch, class, kind, change), then why and the inputs."""
    rev = f"rev {r.revision}" if r.revision is not None else "rev -"
    epoch = f"epoch {r.epoch}" if r.epoch is not None else "epoch -"
    who = r.request_class or "(rollout)"
    head = f"{when(r.at)}  {rev:<7} {epoch:<9} {who:<12} {r.kind}"
    change = change_text(r.before, r.after) if r.after else ""
    if change:
        head += f"  {change}"
    lines = [head + f"  [{r.actor}]"]
    if r.reason:
        lines.append(f"    why: {r.reason}")
    window = _window_line(r.inputs)
    if window:
        lines.append(f"    {window}")
    est = _estimates_line(r.inputs)
    if est:
        lines.append(f"    {est}")
    lines += [f"    {x}" for x in _rules_lines(r.inputs.get("rules") or r.inputs.get("evaluations") or [])]
    if r.kind in ("alert.notify",) or r.inputs.get("source") == "webhook":
        lines.append(f"    alert: rule {r.inputs.get('rule')} via {r.inputs.get('source', '?')}")
    return "\n".join(lines)
