"""``specops dashboard snapshot`` and ``check``: the dashboard's queries against a real Prometheus.

`check_queries` runs every panel expression of the generated dashboard (and, given
a policy, every rendered alert rule: the full condition must parse, its value series
must return data) and reports which come back empty — a panel that shows nothing is
a bug in the dashboard or in the exporter, found without a Grafana server.

`snapshot` renders the main panels (`dashboard.MAIN_PANELS`) with matplotlib from
the same expressions over a time range (``query_range``), so users without Grafana
(and the README) can see what the dashboard shows. Where the controller acted (the
dashboard's `dashboard.ANNOTATIONS`: a class falling back, returning to speculation,
its knob moved) every panel gets a vertical marker, fallbacks and returns named along
their lines in the top panels (`controller_events`). matplotlib is optional: it is imported only here, and a missing
install is one clear error.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specops.alerts import dashboard
from specops.alerts.prometheus_api import PrometheusClient, Series, fill_variables

_LEGEND_VAR = re.compile(r"\{\{\s*(\w+)\s*\}\}")


class SnapshotError(RuntimeError):
    """The snapshot cannot be drawn (matplotlib missing, nothing to draw)."""


@dataclass(frozen=True)
class QueryCheck:
    """One expression's outcome against the live Prometheus."""

    source: str
    """``panel: <title>`` or ``rule: <name> (value|condition)``."""
    expr: str
    series: int
    """Series returned (-1: the query failed)."""
    error: str | None = None
    need_data: bool = True
    """False for an alert's full condition: it may rightly be empty (the alert is not firing)."""

    @property
    def ok(self) -> bool:
        return self.error is None and (self.series > 0 or not self.need_data)


@dataclass
class CheckReport:
    checks: list[QueryCheck] = field(default_factory=list)

    @property
    def failed(self) -> list[QueryCheck]:
        return [c for c in self.checks if not c.ok]

    def lines(self) -> list[str]:
        out = []
        for c in self.checks:
            state = "ok" if c.ok else "FAIL"
            what = c.error or f"{c.series} series"
            out.append(f"{state:<4} {c.source}: {what}")
        return out


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legend format: ``{{class}} head {{head}}`` with the series' labels."""
    return _LEGEND_VAR.sub(lambda m: labels.get(m.group(1), ""), template).strip() or "value"


def check_queries(client: PrometheusClient, *, rate_window: str, policy: Any = None,
                  window: str | None = None) -> CheckReport:
    """Run every dashboard panel query (and the policy's alert rules) once; see the module docstring."""
    from specops.alerts import render  # the policy side is optional

    report = CheckReport()

    def run(source: str, expr: str, need_data: bool = True) -> None:
        try:
            n = len(client.query(expr))
            report.checks.append(QueryCheck(source, expr, n, None, need_data))
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none stops the check
            report.checks.append(QueryCheck(source, expr, -1, str(exc), need_data))

    for panel in dashboard.PANELS:
        run(f"panel: {panel.title}", fill_variables(dashboard.panel_expr(panel), rate_window))
    if policy is not None:
        rule_window = window or render.window_for(policy, render.RenderOptions())
        for rule in policy.alerts:
            run(f"rule: {rule.name} (value)", render.value_expr(rule, rule_window))
            run(f"rule: {rule.name} (condition)", render.alert_expr(rule, rule_window), need_data=False)
    return report


@dataclass(frozen=True)
class ControllerEvent:
    """One controller action seen in its series: ``kind`` is ``fallback``, ``return`` or ``knob``."""

    time: float
    klass: str
    kind: str
    label: str


KNOB_NAMES = {"gamma": "γ", "medusa_heads": "heads"}
EVENT_STYLE = {"fallback": ("red", "-"), "return": ("green", "-"), "knob": ("tab:blue", ":")}


def controller_events(fallbacks: list[Series], knobs: list[Series]) -> list[ControllerEvent]:
    """The controller's actions from its series over a range: each change of a class's
    ``controller_fallbacks_active`` (0 → 1 a fallback, 1 → 0 a return) and of a class's
    ``controller_knob``, at the first point showing the new value. A series's first value is
    where it starts, not an action; NaN points are skipped."""
    events = []

    def changes(series: Series) -> list[tuple[float, float, float]]:
        out, last = [], None
        for t, v in zip(series.times, series.values):
            if v != v:
                continue
            if last is not None and v != last:
                out.append((t, last, v))
            last = v
        return out

    for series in fallbacks:
        name = series.labels.get("class", "?")
        for t, _, v in changes(series):
            kind = "fallback" if v > 0 else "return"
            events.append(ControllerEvent(t, name, kind, f"{name}: {'fallback' if v > 0 else 'speculating'}"))
    for series in knobs:
        name, knob = series.labels.get("class", "?"), series.labels.get("knob", "knob")
        for t, before, v in changes(series):
            events.append(ControllerEvent(t, name, "knob",
                                          f"{name}: {KNOB_NAMES.get(knob, knob)} {before:g}→{v:g}"))
    return sorted(events, key=lambda e: (e.time, e.klass, e.kind))


def _axis_format(ax: Any, unit: str) -> None:
    from matplotlib.ticker import FuncFormatter

    if unit == "percentunit":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 100:.0f}%"))
    elif unit == "s":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1000:.0f} ms" if v < 1 else f"{v:.1f} s"))
    elif unit == "x":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.1f}x"))


def snapshot(client: PrometheusClient, out: Path, *, range_s: float = 900.0, step_s: float | None = None,
             rate_window: str = "1m", titles: tuple[str, ...] = dashboard.MAIN_PANELS,
             clock: Callable[[], float] = time.time) -> dict[str, int]:
    """Draw ``titles`` over the last ``range_s`` seconds into the PNG ``out``; returns series per panel."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.dates as mdates
        import matplotlib.pyplot as plt
    except ImportError:
        raise SnapshotError("matplotlib is not installed: pip install matplotlib") from None
    by_title = {p.title: p for p in dashboard.PANELS}
    unknown = [t for t in titles if t not in by_title]
    if unknown:
        raise SnapshotError(f"no dashboard panel titled {unknown[0]!r}")
    end = clock()
    start = end - range_s
    step = step_s or max(1.0, range_s / 300)
    data = {t: client.query_range(fill_variables(dashboard.panel_expr(by_title[t]), rate_window), start, end, step)
            for t in titles}
    if not any(data.values()):
        raise SnapshotError(f"every panel is empty over the last {range_s:g}s: is Prometheus scraping specops?")
    marks = {a.series: client.query_range(fill_variables(dashboard.panel_expr(
        dashboard.Panel(a.name, a.series, "short")), rate_window), start, end, step) for a in dashboard.ANNOTATIONS}
    events = controller_events(marks.get("controller_fallbacks_active", []), marks.get("controller_knob", []))
    fig = figure(titles, data, events, plt, mdates)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(end))
    span = f"{range_s:.0f} s" if range_s < 600 else f"{range_s / 60:.0f} min"
    fig.suptitle(f"{dashboard.dashboard()['title']} — last {span} to {stamp} (rate window {rate_window})",
                 fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return {t: len(data[t]) for t in titles}


def figure(titles: tuple[str, ...], data: dict[str, list[Series]], events: list[ControllerEvent], plt: Any,
           mdates: Any) -> Any:
    """The snapshot's figure: one axes per panel title (two columns), the controller's events marked on each
    (the markers are lines with ``gid`` ``controller-event:KIND``), fallbacks and returns named in the top row."""
    by_title = {p.title: p for p in dashboard.PANELS}
    cols = 2
    rows = math.ceil(len(titles) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.3 * rows), squeeze=False, sharex=True)
    for i, title in enumerate(titles):
        ax = axes[i // cols][i % cols]
        _draw(ax, by_title[title], data[title], mdates)
        _mark(ax, events, labelled=i < cols)
    for j in range(len(titles), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    return fig


def _mark(ax: Any, events: list[ControllerEvent], labelled: bool) -> None:
    """Vertical markers at the controller's events; ``labelled``: a fallback's or a return's label
    written along its line (knob changes stay unlabelled: the knob panel shows their values)."""
    from datetime import datetime, timezone

    for e in events:
        color, style = EVENT_STYLE[e.kind]
        when = datetime.fromtimestamp(e.time, tz=timezone.utc)
        ax.axvline(when, color=color, linestyle=style, linewidth=1.1, alpha=0.8, gid=f"controller-event:{e.kind}")
        if labelled and e.kind != "knob":
            ax.annotate(e.label, xy=(when, 0.98), xycoords=("data", "axes fraction"), xytext=(-2, 0),
                        textcoords="offset points", fontsize=7, color=color, rotation=90, ha="right", va="top")


def _draw(ax: Any, panel: dashboard.Panel, series: list[Series], mdates: Any) -> None:
    from datetime import datetime, timezone

    ax.set_title(panel.title, fontsize=10)
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    for s in sorted(series, key=lambda s: legend(panel.legend, s.labels)):
        times = [datetime.fromtimestamp(t, tz=timezone.utc) for t in s.times]
        ax.plot(times, s.values, label=legend(panel.legend, s.labels), linewidth=1.4)
    if panel.threshold is not None:
        ax.axhline(panel.threshold, color="red", linestyle="--", linewidth=1, label=f"threshold {panel.threshold:g}")
    flat_zero = series and all(v <= 0 for s in series for v in s.values if v == v)
    ax.set_ylim(bottom=0, top=1 if flat_zero else None)  # an all-zero panel reads 0..1, not 0..0.05
    _axis_format(ax, panel.unit)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=timezone.utc))
    ax.grid(True, alpha=0.3)
    if series or panel.threshold is not None:  # beside the axes: never over a line
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
