"""Adapting a class's speculation knob (γ, or Medusa heads) from measured windows.

Two strategies, both bounded by the policy's ``IntRange`` for the knob:

``goodput``
    A model of one speculation round fitted to the window: the marginal acceptance
    probability of each draft position ``p_i = accepted_per_pos[i] / drafted_per_pos[i]``
    (the rounds that drafted that far; where a source does not report
    ``drafted_per_pos``, every round is taken to have drafted the γ in force, so
    ``p_i = accepted_per_pos[i] / rounds`` with ``rounds = drafted / γ``), the
    draft cost per drafted token, the plain single-token forward cost and the verify
    cost per round. For a candidate length ``k`` the expected tokens per round are
    ``1 + sum(p_i for i < k)`` (the accepted prefix plus the corrected or bonus
    token) and the round costs ``k * draft + verify(k)`` with
    ``verify(k) = plain + b * k`` (``b`` fitted from the measured verify time).
    Positions beyond the measured length are extrapolated with the last measured
    conditional acceptance (acceptance decays geometrically with position).

``bandit``
    Discounted UCB1 over the allowed knob values, rewarded with the measured
    speed-up (tokens per second relative to plain decoding) of windows taken while
    that value was in effect. Discounting forgets old rewards so a traffic shift is
    followed.

The tree size (``tree_size``, an upper bound on the candidate tree's nodes that the
runtime may undercut from its measured verify cost) of a Medusa class, and of an eagle
class that drafts EAGLE-2 trees (``eagle_topk``), is adapted by the bandit in both modes,
over a geometric grid of sizes (:func:`tree_size_arms`): the windows carry no per-node
measurement a goodput model could be fitted to. It moves only on ticks where the class's
knob (heads, γ) holds, so each window measures one change.
Bandit statistics are plain data (:meth:`BanditState.to_dict`) kept in Redis with
the effective settings, so a new leader continues where the old one stopped.

Leaving a fallback (probes at the knob's minimum paid for the rule's ``for_s``), a
``goodput`` class resumes at the guarded goodput choice fitted to the probes
(``with_plain``: the window's plain requests taken out), not at the minimum that
was chosen for cheap probing; the next windows then refine it as usual.

A window whose every request says its knob was a cap the runtime planned each round
under (``WindowStats.planned``: `specops serve`'s engine, which shortens or skips rounds
from its own measured costs at the step's batch size) is only ever raised: both modes
choose within ``[current, max]``, the tree-size grid likewise. Lowering such a cap for
cost would fit the load of the window just measured (a concurrency-16 window cut the
code class's cap, and the next concurrency-1 traffic ran under it); fallback still turns
speculation off where it does not pay.

All of them pass their wish through :func:`guarded_step`: a change must beat the dead-band
(relative expected gain), may not come sooner than the cooldown after the previous
change (and never before a whole window was measured under the current value), and
moves at most ``max_step`` per tick — so settings do not flap. Those two durations are
compared with a small timing slack (``Guard.slack_s``): ticks come once per interval
give or take the scheduler's wake-up and a Redis round trip before the clock is read,
so a cooldown or window that is a whole number of intervals would otherwise be missed
by milliseconds at random and cost a whole extra tick.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class WindowLike(Protocol):
    """The fields of :class:`specops.telemetry.WindowStats` that adaptation reads."""

    requests: int
    new_tokens: int
    drafted: int
    accepted: int
    accepted_per_pos: list[int]
    draft_s: float
    verify_s: float
    wall_s: float
    plain_s_estimate: float


@dataclass(frozen=True)
class RoundModel:
    """One speculation round, fitted to a window measured at knob value ``measured_k``."""

    measured_k: int
    rounds: float
    position_accept: tuple[float, ...]  # p_i: probability that draft position i is accepted
    draft_s_per_token: float
    plain_s_per_token: float
    verify_s_per_extra_token: float  # b in verify(k) = plain + b * k

    @classmethod
    def fit(cls, stats: WindowLike, measured_k: int, *, with_plain: bool = False) -> RoundModel | None:
        """Fit the model, or None when the window cannot support one (no drafts, no time).

        ``with_plain``: the window also holds plain-decoding requests (a fallen-back class:
        plain traffic plus its speculative probes). Their tokens — those beyond the
        speculative rounds' own (accepted + one per round) — are taken out of the verify
        time at the plain per-token cost, so the round model describes the probes alone
        (acceptance and draft cost come from the probes only anyway)."""
        if measured_k < 1 or stats.drafted <= 0 or stats.new_tokens <= 0 or stats.plain_s_estimate <= 0:
            return None
        reached = list(getattr(stats, "drafted_per_pos", None) or [])
        probs = []
        if reached and reached[0] > 0 and sum(reached) == stats.drafted:
            # Rounds of varying length (the serving engine shortens blocks under load): each
            # position's acceptance among the rounds that drafted it, and the plain steps
            # the engine ran between rounds taken out of the verify time like plain requests.
            rounds = float(reached[0])
            for i, n in enumerate(reached[:measured_k]):
                if n <= 0:
                    break
                count = stats.accepted_per_pos[i] if i < len(stats.accepted_per_pos) else 0
                probs.append(min(1.0, max(0.0, count / n)))
            with_plain = True
        else:
            rounds = stats.drafted / measured_k
            for i in range(measured_k):
                count = stats.accepted_per_pos[i] if i < len(stats.accepted_per_pos) else 0
                probs.append(min(1.0, max(0.0, count / rounds)))
        plain = stats.plain_s_estimate / stats.new_tokens
        verify_s = stats.verify_s
        if with_plain:
            plain_tokens = max(0.0, stats.new_tokens - stats.accepted - rounds)
            verify_s = max(0.0, verify_s - plain_tokens * plain)
        verify_round = verify_s / rounds
        b = max(0.0, (verify_round - plain) / (stats.drafted / rounds))  # per drafted token of a mean round
        return cls(
            measured_k=measured_k,
            rounds=rounds,
            position_accept=tuple(probs),
            draft_s_per_token=stats.draft_s / stats.drafted,
            plain_s_per_token=plain,
            verify_s_per_extra_token=b,
        )

    def decay(self) -> float:
        """Conditional acceptance used to extrapolate past the measured positions."""
        p = self.position_accept
        if len(p) >= 2 and p[-2] > 0:
            return min(0.999, p[-1] / p[-2])
        return min(0.999, p[0]) if p else 0.0

    def accept_prob(self, i: int) -> float:
        """Marginal acceptance probability of draft position ``i`` (0-based)."""
        p = self.position_accept
        if i < len(p):
            return p[i]
        return p[-1] * self.decay() ** (i - len(p) + 1)

    def tokens_per_round(self, k: int) -> float:
        return 1.0 + sum(self.accept_prob(i) for i in range(k))

    def seconds_per_round(self, k: int) -> float:
        return k * self.draft_s_per_token + self.plain_s_per_token + self.verify_s_per_extra_token * k

    def goodput(self, k: int) -> float:
        """Expected tokens per second with knob value ``k`` (k = 0: plain decoding)."""
        if k <= 0:
            return 1.0 / self.plain_s_per_token
        return self.tokens_per_round(k) / self.seconds_per_round(k)


@dataclass(frozen=True)
class Guard:
    """Anti-flapping limits, from the class's ``Adaptation`` settings."""

    dead_band: float  # minimum relative expected gain (0.05 = 5 %) for a change
    cooldown_s: float  # minimum seconds between two changes
    max_step: int  # largest change of the knob in one tick
    settle_s: float = 0.0  # a full metrics window must be measured under the current value
    slack_s: float = 0.0  # timing tolerance of the cooldown and settle comparisons (tick jitter)


@dataclass(frozen=True)
class Proposal:
    """What an adapter wants, before the guard: a target value and its expected gain."""

    target: int
    expected_gain: float  # relative: 0.10 = 10 % more tokens/s than the current value
    estimates: dict[int, float] = field(default_factory=dict)  # knob value -> tokens/s (or reward)
    reason: str = ""


@dataclass(frozen=True)
class Step:
    """The guarded outcome for one tick."""

    value: int
    changed: bool
    reason: str


def guarded_step(current: int, proposal: Proposal, *, now: float, last_change_at: float | None, guard: Guard) -> Step:
    """Apply dead-band, cooldown/settling and max-step to ``proposal``."""
    if guard.max_step < 1:
        raise ValueError(f"max_step must be >= 1, got {guard.max_step}")
    if proposal.target == current:
        return Step(current, False, proposal.reason or "already at the best value")
    if last_change_at is not None:
        since = now - last_change_at
        if since + guard.slack_s < guard.cooldown_s:
            return Step(current, False, f"cooldown: {since:.0f}s since last change < {guard.cooldown_s:.0f}s")
        if since + guard.slack_s < guard.settle_s:
            return Step(current, False, f"settling: {since:.0f}s since last change < window {guard.settle_s:.0f}s")
    if proposal.expected_gain < guard.dead_band:
        return Step(current, False, f"dead band: expected gain {proposal.expected_gain:+.1%} < {guard.dead_band:.1%}")
    delta = max(-guard.max_step, min(guard.max_step, proposal.target - current))
    return Step(current + delta, True, f"{proposal.reason}; step {current} -> {current + delta} (target {proposal.target})")


def propose_goodput(stats: WindowLike, current: int, lo: int, hi: int, *,
                    with_plain: bool = False) -> Proposal | None:
    """The knob value in ``[lo, hi]`` with the highest modelled goodput, or None.

    ``with_plain``: the window mixes plain requests with speculation at ``current``
    (see :meth:`RoundModel.fit`)."""
    if lo > hi:
        raise ValueError(f"empty knob range [{lo}, {hi}]")
    model = RoundModel.fit(stats, current, with_plain=with_plain)
    if model is None:
        return None
    estimates = {k: model.goodput(k) for k in range(lo, hi + 1)}
    best = max(estimates, key=lambda k: (estimates[k], -abs(k - current)))
    base = estimates.get(current, model.goodput(current))
    gain = estimates[best] / base - 1.0 if base > 0 else 0.0
    return Proposal(best, gain, estimates, f"goodput {estimates[best]:.1f} tok/s at {best} vs {base:.1f} at {current}")


@dataclass
class BanditState:
    """Discounted UCB1 statistics over knob values for one class."""

    discount: float = 0.9
    exploration: float = 0.1
    weight: dict[int, float] = field(default_factory=dict)  # discounted pull counts
    reward_sum: dict[int, float] = field(default_factory=dict)

    def update(self, arm: int, reward: float) -> None:
        """Record ``reward`` for ``arm``; every arm's history is discounted once."""
        for k in list(self.weight):
            self.weight[k] *= self.discount
            self.reward_sum[k] *= self.discount
        self.weight[arm] = self.weight.get(arm, 0.0) + 1.0
        self.reward_sum[arm] = self.reward_sum.get(arm, 0.0) + reward

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (arm keys as strings)."""
        return {"discount": self.discount, "exploration": self.exploration,
                "weight": {str(k): v for k, v in sorted(self.weight.items())},
                "reward_sum": {str(k): v for k, v in sorted(self.reward_sum.items())}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BanditState:
        """Inverse of :meth:`to_dict`; raises ValueError for malformed data."""
        try:
            weight = {int(k): float(v) for k, v in dict(data.get("weight", {})).items()}
            reward = {int(k): float(v) for k, v in dict(data.get("reward_sum", {})).items()}
            state = cls(discount=float(data.get("discount", 0.9)), exploration=float(data.get("exploration", 0.1)),
                        weight=weight, reward_sum=reward)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed bandit statistics: {exc}") from None
        if set(weight) != set(reward) or not 0 < state.discount <= 1:
            raise ValueError("malformed bandit statistics: arms of weight and reward_sum differ, or bad discount")
        return state

    def mean(self, arm: int) -> float | None:
        w = self.weight.get(arm, 0.0)
        return self.reward_sum[arm] / w if w > 1e-9 else None

    def ucb(self, arm: int) -> float:
        w = self.weight.get(arm, 0.0)
        if w < 1e-3:
            return math.inf
        total = sum(self.weight.values())
        return self.reward_sum[arm] / w + self.exploration * math.sqrt(2.0 * math.log(max(total, 1.0 + 1e-9)) / w)


def tree_size_arms(lo: int, hi: int) -> list[int]:
    """Tree sizes the bandit tries within ``[lo, hi]``: ``lo``, doubling, and ``hi``."""
    if lo < 1 or lo > hi:
        raise ValueError(f"bad tree size range [{lo}, {hi}]")
    arms, n = [], lo
    while n < hi:
        arms.append(n)
        n *= 2
    return [*arms, hi]


def nearest_arm(arms: Sequence[int], value: int) -> int:
    """The arm closest to ``value`` (the smaller one on a tie)."""
    return min(arms, key=lambda a: (abs(a - value), a))


def propose_bandit(state: BanditState, current: int, lo: int, hi: int, arms: Sequence[int] | None = None) -> Proposal:
    """The UCB-best knob value; unexplored values first, nearest to ``current``.

    ``arms``: the values to choose among (default every int in ``[lo, hi]``).
    """
    if lo > hi:
        raise ValueError(f"empty knob range [{lo}, {hi}]")
    arms = list(range(lo, hi + 1)) if arms is None else [a for a in arms if lo <= a <= hi]
    if not arms:
        raise ValueError(f"no bandit arm within [{lo}, {hi}]")
    scores = {k: state.ucb(k) for k in arms}
    best = max(arms, key=lambda k: (scores[k], -abs(k - current)))
    cur = state.mean(current)
    if math.isinf(scores[best]):
        return Proposal(best, math.inf, {k: state.mean(k) or 0.0 for k in arms}, f"bandit: exploring {best}")
    target_mean = state.mean(best) or 0.0
    gain = (target_mean / cur - 1.0) if cur else math.inf
    if best != current and gain <= 0:
        # UCB optimism picked it: treat the exploration bonus as the expected gain.
        gain = scores[best] / max(scores.get(current, 1e-9), 1e-9) - 1.0
    return Proposal(best, gain, {k: state.mean(k) or 0.0 for k in arms}, f"bandit: UCB best {best}")
