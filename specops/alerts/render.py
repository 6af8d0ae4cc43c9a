"""Render a policy's alert rules for Prometheus, the Prometheus Operator and Grafana.

Every expression is built from `specops.telemetry.contract.PROMQL` (the one place the
derived series are defined), so an alert, the dashboard and the controller's Prometheus
source always agree on what "speed-up" or "acceptance rate" means.

Each rule becomes one alert whose expression is::

    (<derived series over the window, restricted to the rule's classes>) <op> <threshold>
      and on (class)
    (<drafted tokens over the window> >= <min_samples>)      # the min-sample guard

with ``for`` = the rule's ``for_s`` and labels ``severity``, ``rule``, ``action`` (plus
``class`` from the series itself), which the webhook maps back to an `AlertAction`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

from specops.policies import AlertRule, Policy
from specops.telemetry import contract

FORMATS = ("prometheus", "prometheus-operator", "grafana")

# Grafana's math expression and threshold comparisons for a rule's op.
_OPS = ("<", "<=", ">", ">=")
_DURATION_RE = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")


class RenderError(ValueError):
    """The policy or the render options cannot be turned into alert rules."""


@dataclass(frozen=True)
class RenderOptions:
    """Choices that are not part of the policy itself."""

    window: str | None = None
    """PromQL range for the derived series (``5m``); None: the policy's rollout analysis window."""
    interval: str = "30s"
    """Rule group evaluation interval."""
    group: str = "specops"
    """Rule group name."""
    name: str = "specops"
    """Kubernetes object name of the PrometheusRule."""
    namespace: str | None = None
    """Kubernetes namespace of the PrometheusRule (omitted when None)."""
    object_labels: tuple[tuple[str, str], ...] = (("app.kubernetes.io/name", "specops"),)
    """Labels on the PrometheusRule object (a Prometheus' ruleSelector matches these)."""
    datasource_uid: str = "prometheus"
    """Grafana: uid of the Prometheus data source the rules query."""
    folder: str = "specops"
    """Grafana: folder the provisioned rules live in."""

    def __post_init__(self) -> None:
        for field_name in ("interval",) + (("window",) if self.window is not None else ()):
            value = getattr(self, field_name)
            if not _DURATION_RE.match(value):
                raise RenderError(f"{field_name} must be a Prometheus duration such as '30s' or '5m', got {value!r}")
        if not self.group or not self.name:
            raise RenderError("group and name must be non-empty")


def duration(seconds: float) -> str:
    """A Prometheus duration string for ``seconds`` (``90s``, ``1500ms``, ``0s``)."""
    if seconds < 0:
        raise RenderError(f"durations must be >= 0, got {seconds}")
    millis = round(seconds * 1000)
    if millis % 1000:
        return f"{millis}ms"
    whole = millis // 1000
    for unit, size in (("h", 3600), ("m", 60)):
        if whole and whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def alert_name(rule: AlertRule) -> str:
    """A valid Prometheus alert name for a policy rule: ``speedup-below-1`` → ``SpecopsSpeedupBelow1``."""
    parts = [p for p in re.split(r"[^A-Za-z0-9]+", rule.name) if p]
    return "Specops" + "".join(p[:1].upper() + p[1:] for p in parts)


def _promql_string(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def class_match(rule: AlertRule) -> str:
    """Label matcher restricting the series to the rule's classes (empty: all classes)."""
    if not rule.classes:
        return ""
    pattern = "|".join(re.escape(c) for c in sorted(rule.classes))
    return f'{contract.CLASS_LABEL}=~"{_promql_string(pattern)}"'


def window_for(policy: Policy, options: RenderOptions) -> str:
    return options.window or duration(policy.rollout.analysis.window_s)


def _value_and_guard(rule: AlertRule, window: str) -> tuple[str, str]:
    match = class_match(rule)
    return contract.promql(rule.metric, window, match), contract.promql(contract.SAMPLE_SERIES, window, match)


def value_expr(rule: AlertRule, window: str) -> str:
    """The rule's derived series with the min-sample guard (no comparison)."""
    value, guard = _value_and_guard(rule, window)
    return f"({value}) and on ({contract.CLASS_LABEL}) ({guard} >= {rule.min_samples})"


def alert_expr(rule: AlertRule, window: str) -> str:
    """The full alert condition: derived series compared with the threshold, guarded by volume."""
    if rule.op not in _OPS:
        raise RenderError(f"rule {rule.name!r}: unknown comparison {rule.op!r}")
    value, guard = _value_and_guard(rule, window)
    return f"({value}) {rule.op} {rule.threshold:g} and on ({contract.CLASS_LABEL}) ({guard} >= {rule.min_samples})"


def _labels(rule: AlertRule) -> dict[str, str]:
    return {"severity": rule.severity, "rule": rule.name, "action": rule.action, "source": "specops"}


def _annotations(rule: AlertRule, policy: Policy) -> dict[str, str]:
    return {
        "summary": f"{rule.metric} {rule.op} {rule.threshold:g} for class {{{{ $labels.class }}}}",
        "description": (
            f"specops policy {policy.version!r} rule {rule.name!r}: {rule.metric} is {{{{ $value }}}} "
            f"({rule.op} {rule.threshold:g} for {duration(rule.for_s)}, at least {rule.min_samples} drafted tokens). "
            f"Action: {rule.action}."
        ),
    }


def prometheus_rules(policy: Policy, options: RenderOptions = RenderOptions()) -> dict:
    """A Prometheus rule file (``groups:``) with one alerting rule per policy alert."""
    window = window_for(policy, options)
    rules = []
    for rule in policy.alerts:
        rules.append({
            "alert": alert_name(rule),
            "expr": alert_expr(rule, window),
            "for": duration(rule.for_s),
            "labels": _labels(rule),
            "annotations": _annotations(rule, policy),
        })
    names = [r["alert"] for r in rules]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise RenderError(f"alert rule names collide after conversion: {', '.join(clashes)}")
    return {"groups": [{"name": options.group, "interval": options.interval, "rules": rules}]}


def prometheus_operator_rule(policy: Policy, options: RenderOptions = RenderOptions()) -> dict:
    """The same rules as a Prometheus Operator ``PrometheusRule`` object."""
    metadata: dict = {"name": options.name, "labels": dict(options.object_labels)}
    if options.namespace:
        metadata["namespace"] = options.namespace
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": metadata,
        "spec": prometheus_rules(policy, options),
    }


def _grafana_uid(rule: AlertRule) -> str:
    uid = "specops-" + re.sub(r"[^A-Za-z0-9_-]", "-", rule.name)
    return uid[:40]


def _seconds(window: str) -> int:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    match = _DURATION_RE.match(window)
    if not match:
        raise RenderError(f"not a duration: {window!r}")
    return max(1, int(int(window[: -len(match.group(1))]) * units[match.group(1)]))


def grafana_provisioning(policy: Policy, options: RenderOptions = RenderOptions()) -> dict:
    """Grafana unified-alerting provisioning (``apiVersion: 1``): one rule per policy alert.

    Query A is the guarded derived series (instant); B reduces it to its last value; C
    is a math condition ``$B <op> threshold`` that fires when true.
    """
    window = window_for(policy, options)
    rules = []
    for rule in policy.alerts:
        rules.append({
            "uid": _grafana_uid(rule),
            "title": alert_name(rule),
            "condition": "C",
            "data": [
                {
                    "refId": "A",
                    "relativeTimeRange": {"from": _seconds(window) + 60, "to": 0},
                    "datasourceUid": options.datasource_uid,
                    "model": {"refId": "A", "expr": value_expr(rule, window), "instant": True, "range": False},
                },
                {
                    "refId": "B",
                    "datasourceUid": "__expr__",
                    "model": {"refId": "B", "type": "reduce", "expression": "A", "reducer": "last",
                              "settings": {"mode": "dropNN"}},
                },
                {
                    "refId": "C",
                    "datasourceUid": "__expr__",
                    "model": {"refId": "C", "type": "math", "expression": f"$B {rule.op} {rule.threshold:g}"},
                },
            ],
            "noDataState": "OK",
            "execErrState": "Error",
            "for": duration(rule.for_s),
            "labels": _labels(rule),
            "annotations": _annotations(rule, policy),
        })
    return {
        "apiVersion": 1,
        "groups": [{
            "orgId": 1,
            "name": options.group,
            "folder": options.folder,
            "interval": options.interval,
            "rules": rules,
        }],
    }


def render(policy: Policy, fmt: str, options: RenderOptions = RenderOptions()) -> str:
    """The rendered document as YAML text; ``fmt`` is one of `FORMATS`."""
    builders = {
        "prometheus": prometheus_rules,
        "prometheus-operator": prometheus_operator_rule,
        "grafana": grafana_provisioning,
    }
    if fmt not in builders:
        raise RenderError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not policy.alerts:
        raise RenderError(f"policy {policy.version!r} has no alert rules to render")
    header = f"# Generated by `specops alerts render --format {fmt}` from policy {policy.version!r}. Do not edit.\n"
    return header + yaml.safe_dump(builders[fmt](policy, options), sort_keys=False, width=1000)
