"""A PNG of the simulation over time (matplotlib is optional: the sidecar install lacks it).

The top axes show fleet throughput (adaptive controller, per-class oracle, the best fixed
γ); the bottom one γ in force per class (0 = plain decoding, a class fallen back). Where
the controller acted (`timeline_events`: a class falling back, returning to speculation,
its γ moved) both axes carry markers: a vertical line with the class's name at each
fallback (red) and return (green), a dot on the class's γ line at each γ change. The
legends sit beside the axes, never over a line.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

EVENT_COLORS = {"fallback": "red", "return": "green"}


@dataclass(frozen=True)
class TimelineEvent:
    """One controller action in the timeline: ``kind`` is ``fallback``, ``return`` or ``gamma``."""

    tick: int
    klass: str
    kind: str
    before: int
    after: int


def timeline_events(rows: list[dict[str, Any]]) -> list[TimelineEvent]:
    """Each change of a class's γ in force between consecutive ticks: to 0 a fallback, from 0 a
    return, otherwise a γ change. A class first seen in a tick starts there (no event)."""
    events = []
    last: dict[str, int] = {}
    for row in rows:
        for name, gamma in sorted(row["gamma"].items()):
            before = last.get(name)
            if before is not None and gamma != before:
                kind = "fallback" if gamma == 0 else "return" if before == 0 else "gamma"
                events.append(TimelineEvent(row["tick"], name, kind, before, gamma))
            last[name] = gamma
    return events


def timeline_figure(result: Any, plt: Any) -> Any:
    """The figure `plot_timeline` saves (markers: lines / points with ``gid`` ``controller-event:KIND``)."""
    rows = result.timeline
    fig = result.figures
    ticks = [r["tick"] for r in rows]
    best = fig["best_fixed"]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    top.plot(ticks, [r["adaptive"] for r in rows], label="adaptive controller")
    top.plot(ticks, [r["oracle"] for r in rows], label="per-class oracle", linestyle="--")
    top.axhline(fig["tokens_per_s"][best], color="grey", linestyle=":", label=f"{best} (run mean)")
    top.set_ylabel("fleet tokens/s")
    top.set_title(f"specops simulate: {fig['pods']} pods x {fig['classes']} classes, "
                  f"adaptive/oracle {fig['adaptive_vs_oracle']:.3f}, /best fixed {fig['adaptive_vs_best_fixed']:.3f}")
    names = sorted(rows[0]["gamma"]) if rows else []
    colors = {}
    for name in names:
        (line,) = bottom.step(ticks, [r["gamma"].get(name, 0) for r in rows], where="post", label=name)
        colors[name] = line.get_color()
    events = timeline_events(rows)
    labelled = set()
    for k, e in enumerate(events):
        if e.kind == "gamma":  # a dot where the class's line moves
            bottom.plot([e.tick], [e.after], marker="o", markersize=3.5, color=colors.get(e.klass, "black"),
                        linestyle="none", gid="controller-event:gamma")
            continue
        color = EVENT_COLORS[e.kind]
        tag = "fallback (γ → 0)" if e.kind == "fallback" else "return to speculation"
        for ax in (top, bottom):
            ax.axvline(e.tick, color=color, linewidth=1.0, alpha=0.7, gid=f"controller-event:{e.kind}",
                       label=tag if ax is top and e.kind not in labelled else None)
        labelled.add(e.kind)
        top.annotate(e.klass, xy=(e.tick, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10 - 9 * (k % 3)),
                     textcoords="offset points", fontsize=7, color=color)
    if any(e.kind == "gamma" for e in events):
        bottom.plot([], [], marker="o", markersize=3.5, color="black", linestyle="none", label="γ changed")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False, fontsize="small")
    bottom.set_ylabel("γ in force (0 = plain / fallback)")
    bottom.set_xlabel("tick")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False, fontsize="small")
    figure.tight_layout()
    return figure


def plot_timeline(result, path: str) -> bool:
    """Plot fleet throughput (adaptive vs oracle) and γ per class with the controller's events; False
    when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = timeline_figure(result, plt)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    log.info("wrote %s", path)
    return True
