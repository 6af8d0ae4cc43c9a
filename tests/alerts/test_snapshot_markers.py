"""The controller's events on the dashboard: Grafana annotations and the snapshot's markers."""

import json

import pytest

from specops.alerts import dashboard
from specops.alerts.prometheus_api import Series
from specops.alerts.snapshot import ControllerEvent, controller_events, figure, snapshot

NAN = float("nan")


def test_events_are_the_changes_of_the_fallback_and_knob_series():
    fallbacks = [Series({"class": "summarise"}, (10, 11, 12, 13, 14, 15), (0, 0, 1, 1, NAN, 0)),
                 Series({"class": "chat"}, (10, 11, 12), (0, 0, 0))]
    knobs = [Series({"class": "summarise", "knob": "gamma"}, (10, 11, 12, 13), (6, 6, 2, 2)),
             Series({"class": "facts", "knob": "medusa_heads"}, (12, 13), (3, 2))]
    events = controller_events(fallbacks, knobs)
    assert events == [
        ControllerEvent(12, "summarise", "fallback", "summarise: fallback"),
        ControllerEvent(12, "summarise", "knob", "summarise: γ 6→2"),
        ControllerEvent(13, "facts", "knob", "facts: heads 3→2"),
        ControllerEvent(15, "summarise", "return", "summarise: speculating"),  # across the NaN gap
    ]
    # a series's first point is where it starts (the controller seeding its gauges), not an action
    assert controller_events([Series({"class": "x"}, (1,), (1,))], []) == []


def test_snapshot_figure_marks_every_event_on_every_panel():
    plt = pytest.importorskip("matplotlib.pyplot")
    import matplotlib.dates as mdates

    titles = dashboard.MAIN_PANELS
    data = {t: [Series({"class": "summarise"}, (10, 11, 12), (1.0, 0.5, 1.0))] for t in titles}
    events = [ControllerEvent(11, "summarise", "fallback", "summarise: fallback"),
              ControllerEvent(12, "summarise", "return", "summarise: speculating")]
    fig = figure(titles, data, events, plt, mdates)
    try:
        axes = [ax for ax in fig.axes if ax.get_visible()]
        assert len(axes) == len(titles)
        for ax in axes:
            gids = sorted(line.get_gid() for line in ax.get_lines() if (line.get_gid() or "").startswith("controller"))
            assert gids == ["controller-event:fallback", "controller-event:return"]
            legend = ax.get_legend()
            assert legend is not None and legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1 - 1  # beside
        labels = [t.get_text() for ax in axes[:2] for t in ax.texts]
        assert labels.count("summarise: fallback") == 2 and labels.count("summarise: speculating") == 2
        assert not any(t.get_text() for ax in axes[2:] for t in ax.texts if t.get_text().startswith("summarise:"))
    finally:
        plt.close(fig)


class FakePrometheus:
    """Answers range queries from canned series; records the expressions asked."""

    def __init__(self, knob_values):
        self.asked = []
        self.knob_values = knob_values

    def query_range(self, expr, start, end, step):
        self.asked.append(expr)
        if "specops_controller_knob" in expr:
            return [Series({"class": "chat", "knob": "gamma"}, (start, start + step), self.knob_values)]
        if "specops_controller_fallbacks_active" in expr:
            return [Series({"class": "chat"}, (start, start + step), (0.0, 0.0))]
        return [Series({"class": "chat"}, (start, start + step), (1.0, 1.0))]


def test_snapshot_reads_the_annotation_series_and_draws_their_events(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from specops.alerts import snapshot as snap

    seen = []
    real = snap.figure
    monkeypatch.setattr(snap, "figure", lambda titles, data, events, plt, mdates:
                        seen.append(events) or real(titles, data, events, plt, mdates))
    client = FakePrometheus((4.0, 2.0))
    out = tmp_path / "d.png"
    counts = snapshot(client, out, range_s=60, rate_window="20s", clock=lambda: 1_000_000.0)
    assert out.stat().st_size > 0 and set(counts) == set(dashboard.MAIN_PANELS)
    assert [e.label for e in seen[0]] == ["chat: γ 4→2"]
    assert sum("specops_controller_knob" in e for e in client.asked) == 2  # its panel and its markers


def test_dashboard_json_carries_the_controller_annotations():
    model = json.loads(dashboard.dashboard_json())
    annotations = model["annotations"]["list"]
    assert [a["name"] for a in annotations] == [a.name for a in dashboard.ANNOTATIONS]
    exprs = {a["name"]: a["expr"] for a in annotations}
    assert exprs["Controller: fallback on / off"] == (
        'changes((max by (class) (specops_controller_fallbacks_active{class=~"$class"}))[$__interval:]) > 0')
    assert "specops_controller_knob" in exprs["Controller: knob changed"]
    assert all(a["enable"] and a["datasource"] == dashboard.DATASOURCE for a in annotations)
