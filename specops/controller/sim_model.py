"""The fleet simulator's world: request classes, cost curves, incidents, the scenario.

Acceptance model: a class has a per-position acceptance ``α`` (already including
the effect of its sampling temperature, ``α = base × (1 − 0.25 × T)``); draft
position ``i`` (0-based) is accepted with marginal probability ``α^(i+1)`` — each
position needs all earlier ones accepted. Costs per round of a draft length ``γ``:
``γ × draft_s + verify(γ)`` with ``verify(γ) = plain_s + verify_slope_s × γ``;
plain decoding costs ``plain_s`` per token. So the expected speed (tokens/s) of a
setting is ``(1 + Σ_{i<γ} α^(i+1)) / (γ draft_s + plain_s + verify_slope_s γ)``.

Seed 0 is the reference world below; every other seed jitters each class's α and
traffic share (``JITTER_*``). Scenario (scaled to ``ticks``): a mid-run traffic shift changes every class's α and
its traffic share; an *acceptance collapse* of one class; a *slow draft* incident
(draft cost × 8) that makes speculation slower than plain decoding at any γ; and a
bad policy rolled out as a canary (γ pinned at the maximum, no adaptation).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# name, base α before / after the shift, traffic share before / after, temperature
_TEMPLATES: tuple[tuple[str, float, float, float, float, float], ...] = (
    ("code", 0.95, 0.92, 0.35, 0.25, 0.0),
    ("qa", 0.80, 0.45, 0.20, 0.15, 0.0),
    ("chat", 0.55, 0.94, 0.15, 0.25, 0.4),
    ("summarize", 0.36, 0.92, 0.15, 0.20, 0.1),
    ("creative", 0.16, 0.13, 0.15, 0.15, 1.0),
)


#: Seeds other than 0 move each template class's α by up to ± this and scale its traffic share
#: by up to e^(± JITTER_LOG_SHARE), so ``--seeds N`` measures N different worlds, not N noise draws.
JITTER_ALPHA = 0.05
JITTER_LOG_SHARE = 0.3


@dataclass(frozen=True)
class Costs:
    """Seconds per step on one pod."""

    plain_s: float = 0.020  # one target forward for one token
    verify_slope_s: float = 0.002  # extra target seconds per extra verified token
    draft_s: float = 0.004  # one draft-model token

    def round_s(self, gamma: int, draft_factor: float = 1.0) -> float:
        return gamma * self.draft_s * draft_factor + self.plain_s + self.verify_slope_s * gamma

    def speed(self, alpha: float, gamma: int, draft_factor: float = 1.0) -> float:
        """Expected tokens/s at draft length ``gamma`` (0 = plain decoding)."""
        if gamma <= 0:
            return 1.0 / self.plain_s
        tokens = 1.0 + sum(alpha ** (i + 1) for i in range(gamma))
        return tokens / self.round_s(gamma, draft_factor)


@dataclass(frozen=True)
class SimClass:
    name: str
    alpha: tuple[float, float]  # effective α before / after the shift
    share: tuple[float, float]  # traffic share before / after the shift (normalised)
    temperature: float


@dataclass(frozen=True)
class Incident:
    kind: str  # "collapse" (α → alpha) | "slow_draft" (draft cost × factor)
    request_class: str
    start_tick: int
    end_tick: int  # exclusive
    alpha: float = 0.05
    factor: float = 8.0

    def active(self, tick: int) -> bool:
        return self.start_tick <= tick < self.end_tick


@dataclass(frozen=True)
class Scenario:
    pods: int
    ticks: int
    seed: int
    classes: tuple[SimClass, ...]
    incidents: tuple[Incident, ...]
    shift_tick: int
    canary_tick: int | None
    interval_s: float = 10.0
    costs: Costs = field(default_factory=Costs)
    gamma_max: int = 12

    def phase(self, tick: int) -> int:
        return 0 if tick < self.shift_tick else 1

    def conditions(self, tick: int) -> dict[str, tuple[float, float, float]]:
        """Per class at ``tick``: (α, traffic share, draft cost factor)."""
        phase = self.phase(tick)
        total = sum(c.share[phase] for c in self.classes)
        out = {}
        for c in self.classes:
            alpha, factor = c.alpha[phase], 1.0
            for inc in self.incidents:
                if inc.request_class == c.name and inc.active(tick):
                    if inc.kind == "collapse":
                        alpha = inc.alpha
                    else:
                        factor = inc.factor
            out[c.name] = (alpha, c.share[phase] / total, factor)
        return out

    def best_setting(self, alpha: float, factor: float, gamma_min: int = 1) -> int:
        """The oracle's choice for one class: the fastest of plain (0) and γ in bounds."""
        options = [0, *range(gamma_min, self.gamma_max + 1)]
        return max(options, key=lambda g: self.costs.speed(alpha, g, factor))


def build_scenario(pods: int, n_classes: int, ticks: int, seed: int) -> Scenario:
    """The standard scenario for ``n_classes`` classes over ``ticks`` ticks (deterministic in ``seed``)."""
    if pods < 1:
        raise ValueError(f"pods must be >= 1, got {pods}")
    if n_classes < 1:
        raise ValueError(f"classes must be >= 1, got {n_classes}")
    if ticks < 20:
        raise ValueError(f"ticks must be >= 20 to fit the scripted incidents, got {ticks}")
    rng = random.Random(seed)
    classes = []
    for i in range(n_classes):
        name, a0, a1, s0, s1, temp = _TEMPLATES[i % len(_TEMPLATES)]
        if i >= len(_TEMPLATES):  # more classes than templates: jittered copies
            name = f"{name}-{i // len(_TEMPLATES)}"
            a0 = min(0.97, max(0.05, a0 + rng.uniform(-0.05, 0.05)))
            a1 = min(0.97, max(0.05, a1 + rng.uniform(-0.05, 0.05)))
        elif seed != 0:  # seed 0 is the reference world; other seeds vary every class's α and share
            a0 = min(0.97, max(0.05, a0 + rng.uniform(-JITTER_ALPHA, JITTER_ALPHA)))
            a1 = min(0.97, max(0.05, a1 + rng.uniform(-JITTER_ALPHA, JITTER_ALPHA)))
            s0 *= math.exp(rng.uniform(-JITTER_LOG_SHARE, JITTER_LOG_SHARE))
            s1 *= math.exp(rng.uniform(-JITTER_LOG_SHARE, JITTER_LOG_SHARE))
        factor = 1.0 - 0.25 * temp
        classes.append(SimClass(name, (round(a0 * factor, 4), round(a1 * factor, 4)), (s0, s1), temp))
    names = [c.name for c in classes]
    incidents = (
        Incident("collapse", names[1 % n_classes], int(0.25 * ticks), int(0.45 * ticks)),
        Incident("slow_draft", names[3 % n_classes], int(0.55 * ticks), int(0.75 * ticks)),
    )
    return Scenario(pods=pods, ticks=ticks, seed=seed, classes=tuple(classes), incidents=incidents,
                    shift_tick=ticks // 2, canary_tick=int(0.82 * ticks))


def binomial(rng: random.Random, n: int, p: float) -> int:
    """A Binomial(n, p) draw: exact for small n, normal approximation for large n."""
    if n <= 0 or p <= 0.0:
        return 0
    if p >= 1.0:
        return n
    if n < 40:
        return sum(1 for _ in range(n) if rng.random() < p)
    mean, sd = n * p, math.sqrt(n * p * (1.0 - p))
    return max(0, min(n, round(rng.gauss(mean, sd))))
