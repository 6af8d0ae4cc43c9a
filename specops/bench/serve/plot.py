"""The plot of a ``specops bench serve`` report."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Two panels: output tokens/s and p99 TPOT against concurrency, one line per mode
    (the rows: with repeats, the median run); with repeats, every run's tokens/s as a faint
    dot beside its mode's point (each mode a little to one side), so the spread that the
    ratios between modes carry is in the picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = list(dict.fromkeys(r["mode"] for r in report["results"]))
    for i, mode in enumerate(modes):
        rows = [r for r in report["results"] if r["mode"] == mode]
        xs = [r["concurrency"] for r in rows]
        line, = left.plot(xs, [r["output_tokens_per_s"] for r in rows], marker="o", label=mode)
        right.plot(xs, [(r["tpot_p99_s"] or 0) * 1000 for r in rows], marker="o", label=mode)
        shift = 2 ** (0.06 * (i - (len(modes) - 1) / 2))  # side by side on the log axis
        for r in rows:
            runs = r.get("output_tokens_per_s_runs") or []
            if len(runs) > 1:
                left.scatter([r["concurrency"] * shift] * len(runs), runs, s=14, alpha=0.5,
                             color=line.get_color(), linewidths=0)
    repeats = max((len(r.get("output_tokens_per_s_runs") or []) for r in report["results"]), default=0)
    spread = f" (line: median run; dots: each of {repeats} runs)" if repeats > 1 else ""
    for ax, title in ((left, "output tokens/s" + spread), (right, "p99 TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
