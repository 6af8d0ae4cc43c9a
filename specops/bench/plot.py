"""Plot a decode benchmark report: tokens/s per method, acceptance by draft position."""

from __future__ import annotations

from pathlib import Path


def plot_report(report: dict, path: str | Path) -> Path:
    """Write a two-panel PNG: (left) median tokens/s per method with its speed-up over
    ``hf-greedy``; (right) acceptance rate at each draft position for the methods that
    report it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    results = report["results"]
    if not results:
        raise ValueError("report has no results to plot")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["method"] for r in results]
    tps = [r["tokens_per_s"] for r in results]
    colors = ["#9e9e9e" if n.startswith("hf-") else "#1f77b4" for n in names]
    bars = left.bar(names, tps, color=colors)
    for bar, r in zip(bars, results):
        label = f"{r['speedup']:.2f}x" if r["speedup"] is not None else ""
        left.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                      fontsize=9)
    left.set_ylabel("tokens/s (median over repeats)")
    left.set_title("Decoding speed (grey: transformers, blue: specops)")
    left.tick_params(axis="x", rotation=30)

    plotted = False
    for r in results:
        acc = r.get("acceptance_by_pos") or []
        if acc:
            right.plot(range(1, len(acc) + 1), acc, marker="o", label=r["method"])
            plotted = True
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance rate")
    right.set_ylim(0, 1.05)
    right.set_title("Acceptance by draft position")
    if plotted:
        right.legend()
    else:
        right.text(0.5, 0.5, "no per-position data", ha="center", va="center", transform=right.transAxes)
    cfg = report.get("config", {})
    fig.suptitle(f"suite={cfg.get('suite')} prompts={report.get('prompts')} max_new_tokens={cfg.get('max_new_tokens')} "
                 f"dtype={cfg.get('dtype')} gamma={cfg.get('gamma')} schedule={cfg.get('schedule')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
