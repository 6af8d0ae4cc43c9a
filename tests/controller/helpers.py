"""Synthetic windows and a fake clock for the controller tests."""

from __future__ import annotations

from specops.controller.sim_model import Costs
from specops.telemetry.records import WindowStats

COSTS = Costs()


class FakeClock:
    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def window(alpha: float, gamma: int, rounds: int = 10_000, costs: Costs = COSTS, draft_factor: float = 1.0,
           requests: int = 100) -> WindowStats:
    """The expected window of ``rounds`` speculation rounds at draft length ``gamma``."""
    per_pos = [round(rounds * alpha ** (i + 1)) for i in range(gamma)]
    accepted = sum(per_pos)
    new_tokens = accepted + rounds
    draft_s = rounds * gamma * costs.draft_s * draft_factor
    verify_s = rounds * (costs.plain_s + costs.verify_slope_s * gamma)
    return WindowStats(requests=requests, new_tokens=new_tokens, drafted=rounds * gamma, accepted=accepted,
                       accepted_per_pos=per_pos, target_forwards=rounds, draft_s=draft_s, verify_s=verify_s,
                       wall_s=draft_s + verify_s, plain_s_estimate=new_tokens * costs.plain_s, gamma=gamma)
