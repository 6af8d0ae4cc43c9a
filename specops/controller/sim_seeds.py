"""``specops simulate --seeds N``: the fleet simulation over several seeds, and its summary.

One seed is one traffic scenario (class mix, shifts, incidents drawn from it). The
controller's quality is judged over seeds, not on one lucky draw: the summary gives
the mean and the minimum of ``adaptive_vs_best_fixed`` (throughput of the adaptive
controller over the best single fixed γ for the whole fleet) and the minimum of
``adaptive_vs_oracle`` (over the per-class, per-tick best γ), against the goals

* mean ``adaptive_vs_best_fixed`` ≥ 1.15 and minimum ≥ 1.10;
* ``adaptive_vs_oracle`` ≥ 0.95 on every seed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specops.controller.sim_model import build_scenario
from specops.controller.simulator import FleetSimulator

GOAL_MEAN_VS_BEST_FIXED = 1.15
GOAL_MIN_VS_BEST_FIXED = 1.10
GOAL_MIN_VS_ORACLE = 0.95


@dataclass(frozen=True)
class SeedSummary:
    """Figures of every seed and the goals over them."""

    figures: list[dict[str, Any]]
    """One ``SimResult.figures`` per seed, in seed order."""

    @property
    def vs_best_fixed(self) -> list[float]:
        return [f["adaptive_vs_best_fixed"] for f in self.figures]

    @property
    def vs_oracle(self) -> list[float]:
        return [f["adaptive_vs_oracle"] for f in self.figures]

    @property
    def mean_vs_best_fixed(self) -> float:
        return statistics.fmean(self.vs_best_fixed)

    @property
    def min_vs_best_fixed(self) -> float:
        return min(self.vs_best_fixed)

    @property
    def min_vs_oracle(self) -> float:
        return min(self.vs_oracle)

    def goals(self) -> dict[str, bool]:
        """Which goal holds (name -> met)."""
        return {
            f"mean adaptive/best fixed >= {GOAL_MEAN_VS_BEST_FIXED}": self.mean_vs_best_fixed >= GOAL_MEAN_VS_BEST_FIXED,
            f"min adaptive/best fixed >= {GOAL_MIN_VS_BEST_FIXED}": self.min_vs_best_fixed >= GOAL_MIN_VS_BEST_FIXED,
            f"adaptive/oracle >= {GOAL_MIN_VS_ORACLE} on every seed": self.min_vs_oracle >= GOAL_MIN_VS_ORACLE,
        }

    def as_dict(self) -> dict[str, Any]:
        return {"seeds": [f["seed"] for f in self.figures], "adaptive_vs_best_fixed": self.vs_best_fixed,
                "adaptive_vs_oracle": self.vs_oracle, "mean_adaptive_vs_best_fixed": round(self.mean_vs_best_fixed, 4),
                "min_adaptive_vs_best_fixed": round(self.min_vs_best_fixed, 4),
                "min_adaptive_vs_oracle": round(self.min_vs_oracle, 4), "goals": self.goals(),
                "runs": self.figures}

    def table(self) -> str:
        """A plain-text table: one row per seed, then mean and minimum."""
        rows = [f"{'seed':>4}  {'best fixed':<10}  {'adaptive/best fixed':>19}  {'adaptive/oracle':>15}"]
        for f in self.figures:
            rows.append(f"{f['seed']:>4}  {f['best_fixed']:<10}  {f['adaptive_vs_best_fixed']:>19.3f}  "
                        f"{f['adaptive_vs_oracle']:>15.3f}")
        rows.append(f"{'mean':>4}  {'':<10}  {self.mean_vs_best_fixed:>19.3f}  "
                    f"{statistics.fmean(self.vs_oracle):>15.3f}")
        rows.append(f"{'min':>4}  {'':<10}  {self.min_vs_best_fixed:>19.3f}  {self.min_vs_oracle:>15.3f}")
        rows += [f"goal {name}: {'met' if ok else 'NOT met'}" for name, ok in self.goals().items()]
        return "\n".join(rows)


def run_seeds(redis_client, *, pods: int, n_classes: int, ticks: int, seeds: list[int],
              progress: Callable[[int], None] | None = None) -> SeedSummary:
    """Simulate every seed in its own (emptied) namespace of ``redis_client``; ``progress`` gets ticks done."""
    if not seeds:
        raise ValueError("at least one seed")
    figures = []
    for i, seed in enumerate(seeds):
        scenario = build_scenario(pods, n_classes, ticks, seed)
        namespace = f"sim-{seed}-{pods}x{n_classes}"
        for key in redis_client.scan_iter(f"{namespace}:*"):  # a re-run starts from an empty namespace
            redis_client.delete(key)
        done = i * ticks
        result = FleetSimulator(scenario, redis_client, namespace=namespace,
                                progress=None if progress is None else (lambda k, d=done: progress(d + k))).run()
        figures.append(result.figures)
    return SeedSummary(figures)
