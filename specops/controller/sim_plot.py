"""A PNG of the simulation over time (matplotlib is optional: the sidecar install lacks it)."""

from __future__ import annotations

import importlib.util
import logging

log = logging.getLogger(__name__)


def plot_timeline(result, path: str) -> bool:
    """Plot fleet throughput (adaptive vs oracle) and γ per class; False when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.timeline
    fig = result.figures
    ticks = [r["tick"] for r in rows]
    best = fig["best_fixed"]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    top.plot(ticks, [r["adaptive"] for r in rows], label="adaptive controller")
    top.plot(ticks, [r["oracle"] for r in rows], label="per-class oracle", linestyle="--")
    top.axhline(fig["tokens_per_s"][best], color="grey", linestyle=":", label=f"{best} (run mean)")
    top.set_ylabel("fleet tokens/s")
    top.legend(loc="lower left")
    top.set_title(f"specops simulate: {fig['pods']} pods x {fig['classes']} classes, "
                  f"adaptive/oracle {fig['adaptive_vs_oracle']:.3f}, /best fixed {fig['adaptive_vs_best_fixed']:.3f}")
    names = sorted(rows[0]["gamma"]) if rows else []
    for name in names:
        bottom.step(ticks, [r["gamma"].get(name, 0) for r in rows], where="post", label=name)
    bottom.set_ylabel("γ in force (0 = plain / fallback)")
    bottom.set_xlabel("tick")
    bottom.legend(loc="upper left", ncol=len(names) or 1, fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    log.info("wrote %s", path)
    return True
