"""The Grafana dashboard, generated from the telemetry contract's PromQL.

Every panel query is `specops.telemetry.contract.promql(...)` with the Grafana
variables ``$__rate_interval`` (window) and ``class=~"$class"`` (selected classes), so
the dashboard shows exactly what the alert rules and the controller evaluate.

The committed copy lives at ``charts/specops/dashboards/specops.json`` (the Helm chart
ships it in a ConfigMap for Grafana's dashboard sidecar); a test checks it equals
`dashboard_json()`. Regenerate with::

    python -m specops.alerts.dashboard charts/specops/dashboards/specops.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from specops.telemetry import controller_series as controller_metrics
from specops.telemetry import contract

UID = "specops-overview"
WINDOW = "$__rate_interval"
MATCH = f'{contract.CLASS_LABEL}=~"$class"'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Panel:
    """One time-series panel: a derived series from the contract."""

    title: str
    series: str
    """Key of `contract.PROMQL` (runtime series) or of `specops.telemetry.controller_series.PROMQL` (``controller_*``)."""
    unit: str
    """Grafana unit id (``percentunit``, ``s``, ``short``...)."""
    legend: str = "{{class}}"
    description: str = ""
    threshold: float | None = None
    """Draw a red threshold line here (e.g. speed-up 1)."""


PANELS: tuple[Panel, ...] = (
    Panel("Speed-up vs plain decoding", "speedup", "x", threshold=1.0,
          description="Plain-decoding time estimate / time taken. Below 1: speculation makes decoding slower."),
    Panel("Acceptance rate", "acceptance_rate", "percentunit", threshold=0.5,
          description="Accepted draft tokens / drafted tokens."),
    Panel("Tokens/s per request stream", "tokens_per_s", "short",
          description="Generated tokens / seconds spent decoding."),
    Panel("Throughput (tokens/s, fleet)", "throughput_tokens_per_s", "short"),
    Panel("p50 token latency", "p50_token_latency_s", "s"),
    Panel("p99 token latency", "p99_token_latency_s", "s"),
    Panel("Tokens per target forward", "mean_accepted_len", "short",
          description="Mean accepted length: generated tokens / target forward passes."),
    Panel("Medusa head accuracy", "head_accuracy", "percentunit", legend="{{class}} head {{head}}"),
    Panel("Accepted tokens/s by draft position", "accepted_by_position_rate", "short",
          legend="{{class}} pos {{position}}"),
    Panel("Fallbacks to plain decoding (per s)", "fallback_rate", "short"),
    Panel("Speculation length γ", "gamma", "short"),
    Panel("Medusa heads in use", "medusa_heads", "short"),
    Panel("Classes fallen back (controller)", "controller_fallbacks_active", "short",
          description="1 while the controller keeps the class on plain decoding (probes still speculate)."),
    Panel("Knob set by the controller", "controller_knob", "short", legend="{{class}} {{knob}}",
          description="γ (draft, ngram) or Medusa heads, as the controller last wrote them."),
    Panel("Controller decisions per window", "controller_decisions", "short", legend="{{class}} {{kind}}",
          description="Decisions by kind (hold and inconclusive included: the loop is alive)."),
)

#: The panels `specops dashboard snapshot` draws (titles of `PANELS`).
MAIN_PANELS: tuple[str, ...] = (
    "Speed-up vs plain decoding", "Acceptance rate", "Tokens/s per request stream", "p99 token latency",
    "Knob set by the controller", "Classes fallen back (controller)",
)


@dataclass(frozen=True)
class Annotation:
    """Where the controller acted, marked on every panel: each change of a controller series's value."""

    name: str
    series: str
    """Key of `specops.controller.metrics.PROMQL` whose changes mark the event."""
    color: str
    text: str
    """Grafana's ``textFormat`` (the series's labels in ``{{ }}``)."""


#: Grafana annotations (and `specops dashboard snapshot`'s markers): a class falling back to plain
#: decoding or returning to speculation, and the controller moving a class's knob (γ, Medusa heads).
ANNOTATIONS: tuple[Annotation, ...] = (
    Annotation("Controller: fallback on / off", "controller_fallbacks_active", "red",
               "{{class}} fallen back (1) / speculating again (0)"),
    Annotation("Controller: knob changed", "controller_knob", "blue", "{{class}} {{knob}} set"),
)


def annotation_expr(annotation: Annotation, window: str = "$__interval", match: str = MATCH) -> str:
    """The annotation's PromQL: the series where its value changed within ``window`` (Grafana marks each
    returned point; the snapshot reads the series's values itself: `specops.alerts.snapshot.controller_events`)."""
    return f"changes(({controller_metrics.promql(annotation.series, window, match)})[{window}:]) > 0"


def _annotation(annotation: Annotation) -> dict:
    return {
        "name": annotation.name,
        "datasource": DATASOURCE,
        "enable": True,
        "iconColor": annotation.color,
        "expr": annotation_expr(annotation),
        "step": "$__interval",
        "titleFormat": annotation.name,
        "textFormat": annotation.text,
        "tagKeys": "class",
        "useValueForTime": False,
    }


def panel_expr(panel: Panel, window: str = WINDOW, match: str = MATCH) -> str:
    """The panel's PromQL (a runtime contract series, or a controller one)."""
    if panel.series in controller_metrics.PROMQL:
        return controller_metrics.promql(panel.series, window, match)
    return contract.promql(panel.series, window, match)


def _panel(index: int, panel: Panel) -> dict:
    width, height = 12, 8
    defaults: dict = {"unit": panel.unit, "min": 0}
    if panel.threshold is not None:
        defaults["custom"] = {"thresholdsStyle": {"mode": "line"}}
        defaults["thresholds"] = {"mode": "absolute", "steps": [
            {"color": "red", "value": None}, {"color": "green", "value": panel.threshold}]}
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": (index % 2) * width, "y": (index // 2) * height, "w": width, "h": height},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{
            "refId": "A",
            "datasource": DATASOURCE,
            "expr": panel_expr(panel),
            "legendFormat": panel.legend,
        }],
    }


def dashboard() -> dict:
    """The dashboard model (Grafana JSON)."""
    return {
        "uid": UID,
        "title": "specops: speculative decoding",
        "description": "Generated by specops.alerts.dashboard from the telemetry contract. Do not edit by hand.",
        "tags": ["specops", "speculative-decoding"],
        "editable": False,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "utc",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "class", "label": "Request class", "type": "query", "datasource": DATASOURCE,
             "query": {"query": f"label_values({contract.REQUESTS.name}, {contract.CLASS_LABEL})", "refId": "classes"},
             "definition": f"label_values({contract.REQUESTS.name}, {contract.CLASS_LABEL})",
             "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*", "current": {}, "hide": 0, "sort": 1},
        ]},
        "annotations": {"list": [_annotation(a) for a in ANNOTATIONS]},
        "panels": [_panel(i, p) for i, p in enumerate(PANELS)],
    }


def dashboard_json() -> str:
    """The dashboard as committed: stable key order, two-space indent, trailing newline."""
    return json.dumps(dashboard(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the dashboard to the path given (or stdout)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        sys.stderr.write("usage: python -m specops.alerts.dashboard [OUTPUT.json]\n")
        return 2
    if args:
        Path(args[0]).write_text(dashboard_json())
    else:
        sys.stdout.write(dashboard_json())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
