"""The controller's logging: quiet libraries, text or JSON lines, one line per decision.

``configure_logging`` sets up the root logger for ``specops controller run``:

* ``text`` — ``2026-12-01T04:30:00Z INFO specops.decision: code adapt gamma 4->5 (goodput ...)``;
* ``json`` — one JSON object per line (``ts``, ``level``, ``logger``, ``msg`` and, for a
  decision, a ``decision`` object with its class, kind, reason, before/after and the
  policy revision and leader epoch), for log collectors in Kubernetes.

APScheduler logs every job run at INFO ("Running job ... executed successfully");
its loggers are set to WARNING unless ``--log-level debug`` asks for everything.

Every decision that changed something is logged once, at INFO, on one line, by
:func:`log_decisions` (holds and inconclusive windows at DEBUG).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
QUIET_LOGGERS = ("apscheduler", "urllib3", "werkzeug")
DECISION_LOGGER = "specops.decision"

_decision_log = logging.getLogger(DECISION_LOGGER)


def _utc(created: float) -> str:
    millis = int((created % 1) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record; structured extras (``decision``) are kept as objects."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _utc(record.created), "level": record.levelname.lower(), "logger": record.name,
                               "msg": record.getMessage()}
        decision = getattr(record, "decision", None)
        if decision is not None:
            out["decision"] = decision
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, sort_keys=False)


class TextFormatter(logging.Formatter):
    """``TIMESTAMP LEVEL LOGGER: message`` with a UTC ISO timestamp."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_utc(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(fmt: str = "text", level: str = "info", stream: Any = None) -> logging.Handler:
    """Install one handler on the root logger (replacing one an earlier call installed); returns it."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.specops_owned = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in list(root.handlers):  # replace an earlier call's handler; leave others' (pytest's) alone
        if getattr(old, "specops_owned", False):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    quiet = logging.DEBUG if level == "debug" else logging.WARNING
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
    return handler


def describe(decision: Any) -> str:
    """One readable line for a controller ``Decision``: class, kind, knob change and why."""
    who = decision.request_class or "rollout"
    changes = [f"{k} {decision.before.get(k)}->{v}" for k, v in decision.after.items()
               if k in decision.before and decision.before.get(k) != v]
    parts = [who, decision.kind] + changes
    return f"{' '.join(str(p) for p in parts)}: {decision.reason}"


def log_decisions(decisions: Iterable[Any], *, revision: int | None = None, epoch: int | None = None) -> None:
    """Log each decision once: INFO when it changed something, DEBUG for holds."""
    for d in decisions:
        level = logging.INFO if d.changed else logging.DEBUG
        if not _decision_log.isEnabledFor(level):
            continue
        payload = {**d.as_dict(), "revision": revision, "epoch": epoch}
        _decision_log.log(level, describe(d), extra={"decision": payload})


def logged(fn: Callable[..., list[Any]], context: Callable[[], tuple[int | None, int | None]]) -> Callable[..., list[Any]]:
    """Wrap a function returning decisions (``Controller.tick``, ``apply_alert``) so they are logged.

    ``context`` returns the (policy revision, leader epoch) to record with them.
    """

    def run(*args: Any, **kwargs: Any) -> list[Any]:
        decisions = fn(*args, **kwargs)
        if decisions:
            try:
                revision, epoch = context()
            except Exception:  # the store may be down: the decisions are still worth a line
                revision, epoch = None, None
            log_decisions(decisions, revision=revision, epoch=epoch)
        return decisions

    return run
