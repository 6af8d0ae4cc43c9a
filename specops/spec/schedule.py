"""Speculation-length (γ) schedules within one request.

A schedule proposes γ before each speculation step and learns from its outcome:

``constant``
    always the same γ (the bounds do not apply).
``heuristic``
    grow γ by 2 after a fully accepted block, shrink it by 1 after a rejection (the
    rule transformers' assisted generation uses), within ``[gamma_min, gamma_max]``.
``goodput``
    choose the γ that maximises expected tokens per second. With a per-token acceptance
    probability α (estimated from this request's outcomes) a block of γ drafted tokens
    yields on average ``(1 - α^(γ+1)) / (1 - α)`` tokens (Leviathan et al. 2023, eq. 1)
    and costs ``γ · c_draft + c_verify(γ + 1)`` seconds, with ``c_draft`` the measured
    seconds per drafted token and ``c_verify(T) = a + b·T`` a line fitted to the measured
    verification times of T-token target passes.

The controller later sets ``gamma_min`` / ``gamma_max`` per request class; the
runtime only clamps γ further to the remaining token budget and context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from specops.spec.errors import InvalidRequestError

SCHEDULES = ("constant", "heuristic", "goodput")


class GammaSchedule(Protocol):
    """What the speculation loops need from a schedule."""

    def next_gamma(self) -> int:
        """γ for the next speculation step (within the schedule's bounds)."""
        ...

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """Record one step: tokens drafted and accepted, seconds drafting and verifying."""
        ...


@dataclass
class ConstantSchedule:
    """γ never changes."""

    gamma: int

    def next_gamma(self) -> int:
        return self.gamma

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        return None


@dataclass
class HeuristicSchedule:
    """Grow on full acceptance (+``grow``), shrink on rejection (-``shrink``)."""

    gamma: int
    gamma_min: int
    gamma_max: int
    grow: int = 2
    shrink: int = 1

    def next_gamma(self) -> int:
        return self.gamma

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if drafted <= 0:
            return
        if accepted >= drafted:
            self.gamma = min(self.gamma_max, self.gamma + self.grow)
        else:
            self.gamma = max(self.gamma_min, self.gamma - self.shrink)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens emitted by one verification of γ drafted tokens at per-token acceptance α."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class GoodputSchedule:
    """Pick γ maximising expected tokens/s from running acceptance and cost estimates."""

    gamma: int
    """γ used until the first measurement (and the starting point)."""
    gamma_min: int
    gamma_max: int
    decay: float = 0.9
    """Weight kept by old observations per step, so the estimates follow drift."""
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    """Beta-style prior on α: ``prior_weight`` pseudo-trials at ``prior_alpha``."""
    _successes: float = field(default=0.0, init=False)
    _trials: float = field(default=0.0, init=False)
    _draft_s: float = field(default=0.0, init=False)
    _draft_n: float = field(default=0.0, init=False)
    # exponentially weighted sums for the least-squares line c_verify(T) = a + b*T
    _w: float = field(default=0.0, init=False)
    _st: float = field(default=0.0, init=False)
    _stt: float = field(default=0.0, init=False)
    _sy: float = field(default=0.0, init=False)
    _sty: float = field(default=0.0, init=False)

    @property
    def alpha(self) -> float:
        """Current per-token acceptance estimate."""
        num = self._successes + self.prior_alpha * self.prior_weight
        den = self._trials + self.prior_weight
        return min(max(num / den, 0.0), 1.0)

    def draft_cost(self) -> float | None:
        """Seconds per drafted token, or None before any drafting was measured."""
        return self._draft_s / self._draft_n if self._draft_n > 0 else None

    def verify_cost(self, tokens: int) -> float | None:
        """Estimated seconds for a target pass over ``tokens`` positions (None before data)."""
        if self._w <= 0:
            return None
        mean_t = self._st / self._w
        mean_y = self._sy / self._w
        var_t = self._stt / self._w - mean_t * mean_t
        slope = 0.0
        if var_t > 1e-9:
            slope = max(0.0, (self._sty / self._w - mean_t * mean_y) / var_t)
        intercept = mean_y - slope * mean_t
        return max(intercept + slope * tokens, 1e-9)

    def expected_rate(self, gamma: int) -> float | None:
        """Expected tokens per second at ``gamma`` (None until costs were measured)."""
        c_draft = self.draft_cost()
        c_verify = self.verify_cost(gamma + 1)
        if c_draft is None or c_verify is None:
            return None
        return expected_tokens(self.alpha, gamma) / (gamma * c_draft + c_verify)

    def next_gamma(self) -> int:
        rates = {g: self.expected_rate(g) for g in range(self.gamma_min, self.gamma_max + 1)}
        if any(r is None for r in rates.values()):
            return self.gamma
        self.gamma = max(rates, key=lambda g: (rates[g], -g))
        return self.gamma

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if drafted <= 0:
            return
        d = self.decay
        # Each drafted token up to the first rejection is a Bernoulli(α) trial.
        trials = accepted + (1 if accepted < drafted else 0)
        self._successes = d * self._successes + accepted
        self._trials = d * self._trials + trials
        self._draft_s = d * self._draft_s + max(draft_s, 0.0)
        self._draft_n = d * self._draft_n + drafted
        t = float(drafted + 1)
        y = max(verify_s, 0.0)
        self._w = d * self._w + 1.0
        self._st = d * self._st + t
        self._stt = d * self._stt + t * t
        self._sy = d * self._sy + y
        self._sty = d * self._sty + t * y


def make_schedule(name: str, gamma: int, gamma_min: int = 1, gamma_max: int = 8) -> GammaSchedule:
    """Build a schedule by name, validating the bounds (γ is clamped into them)."""
    for label, value in (("gamma", gamma), ("gamma_min", gamma_min), ("gamma_max", gamma_max)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequestError(f"{label} must be an integer, got {value!r}")
        if value < 1:
            raise InvalidRequestError(f"{label} must be >= 1, got {value}")
    if gamma_min > gamma_max:
        raise InvalidRequestError(f"gamma_min ({gamma_min}) must be <= gamma_max ({gamma_max})")
    if name == "constant":
        return ConstantSchedule(gamma)
    start = min(max(gamma, gamma_min), gamma_max)
    if name == "heuristic":
        return HeuristicSchedule(start, gamma_min, gamma_max)
    if name == "goodput":
        return GoodputSchedule(start, gamma_min, gamma_max)
    raise InvalidRequestError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
