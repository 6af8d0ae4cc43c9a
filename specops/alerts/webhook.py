"""Alert webhooks: Alertmanager (payload version "4") and Grafana (webhook contact point, version "1").

Both deliver a JSON object with an ``alerts`` list; each alert has a ``status``
(``firing`` | ``resolved``), ``labels``, ``startsAt`` and a ``fingerprint``. Alerts
rendered by `specops.alerts.render` carry the labels ``class``, ``rule`` and
``action``; each firing one becomes an `AlertAction` for the controller. A
hand-written rule (Grafana's UI) needs at least ``rule`` naming a rule of the current
policy — the action is then the policy's — or ``action`` (with ``rule`` or
``alertname`` as its name); ``class`` restricts a fallback to one class (see
docs/alerts.md).

Rules enforced here:

- a bearer token is required (``Authorization: Bearer <token>``, compared in constant time);
- only ``firing`` alerts act; ``resolved`` ones are ignored (they only clear the dedupe
  entry, so a later re-fire acts again);
- an alert is acted on once per fingerprint: Alertmanager re-sends firing alerts every
  ``repeat_interval`` and Grafana on every evaluation; the repeats are dropped;
- alerts with neither an ``action`` nor a ``rule`` label are ignored (logged), not errors;
- a firing alert whose ``action`` label is not one of `ACTION_KINDS` is refused like one
  the controller cannot apply (unknown class or rule: `AlertRejected`): a client error
  (422, logged, naming the label and its value; the others of the delivery still act); one it cannot
  apply *now* (not the leader, Redis down: `AlertDeferred`) is answered 503 with
  ``Retry-After`` and its fingerprint is not remembered, so the resend acts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

log = logging.getLogger(__name__)

ACTION_KINDS = ("fallback", "rollback", "notify")
SOURCES = {"alertmanager": "4", "grafana": "1"}  # webhook source -> payload version it must carry
MAX_BODY_BYTES = 1_000_000


@dataclass(frozen=True)
class AlertAction:
    """What a firing alert asks the controller to do."""

    kind: str | None
    """``fallback`` (the class to plain decoding) | ``rollback`` (the policy) | ``notify``;
    None: the action of the policy rule named ``rule`` (an alert without ``action`` label)."""
    request_class: str | None
    """Class the alert is about (its ``class`` label); None for fleet-wide alerts."""
    rule: str
    """Policy alert rule name (its ``rule`` label, else ``alertname``)."""
    fingerprint: str
    """The alert's fingerprint (stable for one label set)."""
    starts_at: float | None = None
    """When the alert started firing (its ``startsAt``, Unix seconds); None if not given."""

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in ACTION_KINDS:
            raise ValueError(f"AlertAction.kind must be one of {', '.join(ACTION_KINDS)}, got {self.kind!r}")


class AlertRejected(ValueError):
    """The controller cannot apply this alert (names an unknown class or rule): a client error."""


class AlertDeferred(RuntimeError):
    """The controller cannot apply this alert now (not the leader, Redis down): the sender must retry."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WebhookError(Exception):
    """A delivery is refused; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass
class WebhookResult:
    """The outcome of one accepted delivery."""

    actions: list[AlertAction] = field(default_factory=list)
    """Actions passed to the callback (new firing alerts)."""
    duplicates: int = 0
    """Firing alerts already acted on (same fingerprint)."""
    ignored: int = 0
    """Resolved alerts and alerts without specops labels."""
    rejected: list[str] = field(default_factory=list)
    """Why each alert the controller could not apply was refused (answered 422)."""


def _fingerprint(alert: dict) -> str:
    given = alert.get("fingerprint")
    if isinstance(given, str) and given:
        return given
    labels = json.dumps(alert.get("labels", {}), sort_keys=True)
    return hashlib.sha256(labels.encode()).hexdigest()[:16]


_FRACTION = re.compile(r"(\.\d{6})\d+")


def parse_time(value: object) -> float | None:
    """An RFC 3339 timestamp (``startsAt``; nanoseconds allowed) as Unix seconds; None if absent or zero."""
    if not isinstance(value, str) or not value or value.startswith("0001-"):
        return None
    text = _FRACTION.sub(r"\1", value.strip()).replace("Z", "+00:00").replace("z", "+00:00")
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise WebhookError(400, f"startsAt {value!r} is not an RFC 3339 time") from None
    if parsed.tzinfo is None:
        raise WebhookError(400, f"startsAt {value!r} has no time zone")
    return parsed.timestamp()


def parse_payload(source: str, body: bytes) -> list[tuple[str, AlertAction | AlertRejected | None]]:
    """(status, what it asks) per alert of a delivery; raises `WebhookError` (400) if malformed.

    What it asks is an `AlertAction`, None for an alert without specops labels (or a resolved
    one with an unknown ``action``), or an `AlertRejected` for a firing alert whose ``action``
    label names no known action.
    """
    if source not in SOURCES:
        raise WebhookError(404, f"unknown webhook source {source!r}")
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WebhookError(400, f"body is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise WebhookError(400, "payload must be a JSON object")
    version = payload.get("version")
    if str(version) != SOURCES[source]:
        raise WebhookError(400, f"{source} payload version must be {SOURCES[source]!r}, got {version!r}")
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise WebhookError(400, "payload.alerts must be a list")
    parsed: list[tuple[str, AlertAction | AlertRejected | None]] = []
    for i, alert in enumerate(alerts):
        if not isinstance(alert, dict):
            raise WebhookError(400, f"payload.alerts[{i}] must be an object")
        status = alert.get("status")
        labels = alert.get("labels")
        if status not in ("firing", "resolved"):
            raise WebhookError(400, f"payload.alerts[{i}].status must be 'firing' or 'resolved', got {status!r}")
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise WebhookError(400, f"payload.alerts[{i}].labels must be an object of strings")
        kind = labels.get("action") or None  # an empty label is an absent one (as in Prometheus)
        rule = labels.get("rule") or labels.get("alertname")
        if kind is not None and kind not in ACTION_KINDS:
            if status == "firing":
                parsed.append((status, AlertRejected(
                    f"{rule or _fingerprint(alert)}: label action={kind!r} is not one of {', '.join(ACTION_KINDS)}")))
            else:
                parsed.append((status, None))  # a resolved alert acts on nothing
            continue
        from_policy = kind is None and bool(labels.get("rule"))  # no action label: the policy's rule says
        if not from_policy and (kind is None or not rule):
            log.info("ignoring %s alert %r without specops action/rule labels", source, labels.get("alertname"))
            parsed.append((status, None))
            continue
        parsed.append((status, AlertAction(kind=kind, request_class=labels.get("class") or None, rule=rule,
                                           fingerprint=_fingerprint(alert),
                                           starts_at=parse_time(alert.get("startsAt")))))
    return parsed


class WebhookReceiver:
    """Authenticates deliveries, drops repeats and calls ``on_alert`` once per firing alert."""

    def __init__(self, token: str, on_alert: Callable[[AlertAction], None], *,
                 clock: Callable[[], float] = time.monotonic, dedupe_ttl_s: float = 24 * 3600,
                 max_remembered: int = 10_000) -> None:
        token = (token or "").strip()  # a token read from a secret file usually ends in a newline
        if not token:
            raise ValueError("a webhook bearer token is required (set SPECOPS_WEBHOOK_TOKEN)")
        if dedupe_ttl_s <= 0 or max_remembered <= 0:
            raise ValueError("dedupe_ttl_s and max_remembered must be positive")
        self._token = token.encode()
        self.on_alert = on_alert
        self.clock = clock
        self.dedupe_ttl_s = dedupe_ttl_s
        self.max_remembered = max_remembered
        self._seen: OrderedDict[str, float] = OrderedDict()  # fingerprint -> time acted on
        self._lock = threading.Lock()

    def authorize(self, authorization: str | None) -> None:
        """Raise `WebhookError` (401) unless the header carries the bearer token."""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise WebhookError(401, "missing bearer token")
        if not hmac.compare_digest(given.strip().encode(), self._token):
            raise WebhookError(401, "wrong bearer token")

    def _forget_expired(self, now: float) -> None:
        while self._seen:
            fingerprint, when = next(iter(self._seen.items()))
            if now - when < self.dedupe_ttl_s and len(self._seen) <= self.max_remembered:
                break
            self._seen.popitem(last=False)

    def handle(self, source: str, authorization: str | None, body: bytes) -> WebhookResult:
        """Process one delivery. Raises `WebhookError` for refused ones.

        If ``on_alert`` raises, the fingerprint is not remembered: `AlertRejected` is
        collected (422 once the delivery is done), `AlertDeferred` becomes a 503 with
        ``Retry-After``, anything else propagates (500; the sender retries).
        """
        self.authorize(authorization)
        if len(body) > MAX_BODY_BYTES:
            raise WebhookError(413, f"payload larger than {MAX_BODY_BYTES} bytes")
        result = WebhookResult()
        for status, action in parse_payload(source, body):
            if action is None:
                result.ignored += 1
                continue
            if isinstance(action, AlertRejected):
                log.warning("%s alert refused: %s", source, action)
                result.rejected.append(str(action))
                continue
            with self._lock:
                now = self.clock()
                self._forget_expired(now)
                if status == "resolved":
                    self._seen.pop(action.fingerprint, None)
                    result.ignored += 1
                    continue
                if action.fingerprint in self._seen:
                    result.duplicates += 1
                    continue
                self._seen[action.fingerprint] = now
            try:
                self.on_alert(action)
            except AlertRejected as exc:
                with self._lock:
                    self._seen.pop(action.fingerprint, None)
                log.warning("%s alert %s (%s) rejected: %s", source, action.rule, action.fingerprint, exc)
                result.rejected.append(f"{action.rule}: {exc}")
                continue
            except AlertDeferred as exc:
                with self._lock:
                    self._seen.pop(action.fingerprint, None)
                raise WebhookError(503, str(exc), retry_after_s=exc.retry_after_s) from None
            except Exception:
                with self._lock:
                    self._seen.pop(action.fingerprint, None)
                raise
            log.info("alert %s (%s) for class %s: %s", action.rule, action.fingerprint, action.request_class,
                     action.kind or "the policy's action")
            result.actions.append(action)
        return result
