"""``method="auto"`` in the serving engine: which speculation a request runs, from live results.

`Decoder.generate(method="auto")` switches drafter step by step inside one request
(`specops.spec.auto`). In the engine the drafters that keep per-request state (a draft
cache, an EAGLE cursor, Medusa's hidden state) are chosen once, at admission, and prompt
lookup (stateless) is weighed against a chain drafter before every step (`StepChoice`). Both
choices use the library's rule (`specops.spec.chooser.choose`). At admission it keeps one
chooser per request class and greedy/sampled (what pays for code at temperature 0 is not what
pays for prose at temperature 1), and each keeps, per available method, a running estimate
of the tokens committed per target forward by the requests that ran it. Methods without
``min_samples`` finished requests are tried first, in turn; then the best runs, and a worse
method is tried again when the rule says it is due (`ADMISSION_RULE`: its tries cost at most
2% of the requests, and none waits more than 50 admissions), so an estimate that has gone
stale (traffic changed, the planner turned speculation off for a while) is refreshed. Cost
is not in the score on purpose: the spec planner already speculates only when the measured
gain beats the measured cost (γ = 0 otherwise), so a method that does not pay commits ~1
token per forward and loses to one that does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from specops.spec.chooser import ChoiceClock, ProbeRule, choose

ADMISSION_RULE = ProbeRule(every=4, budget=0.02, max_wait=50)
"""The probe rule of admissions: a worse method is tried again every 4..50 admissions of its kind."""


@dataclass
class MethodChooser:
    """Per-method running score (tokens per target forward) and the admission choice."""

    decay: float = 0.2
    """Weight of each finished request in the running score (exponential average)."""
    min_samples: int = 3
    """Finished requests per method before its score is trusted."""
    rule: ProbeRule = ADMISSION_RULE
    clock: ChoiceClock = field(default_factory=ChoiceClock)
    scores: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)

    def choose(self, available: tuple[str, ...]) -> str:
        """One of ``available`` (non-empty) for a new request."""
        if not available:
            raise ValueError("auto needs at least one speculative method to choose from")
        untried = [m for m in available if self.samples.get(m, 0) < self.min_samples]
        picked = choose({m: self.scores.get(m, 0.0) for m in available}, self.clock, self.rule, untried=untried)
        self.clock.used(picked)
        return picked
    def observe(self, method: str, new_tokens: int, target_forwards: int) -> None:
        """Account one finished request that ran ``method`` (prefill forward excluded)."""
        decode_forwards = target_forwards - 1
        if decode_forwards < 1 or new_tokens < 1:
            return
        value = (new_tokens - 1) / decode_forwards  # the prefill's forward commits the first token
        old = self.scores.get(method)
        self.scores[method] = value if old is None else (1 - self.decay) * old + self.decay * value
        self.samples[method] = self.samples.get(method, 0) + 1


@dataclass
class Profile:
    """One option's acceptance state on a sequence (the `Sequence` fields of that name)."""

    alpha: float
    acc_hits: float
    acc_trials: float
    accept_scale: float
    prior_key: tuple


class StepChoice:
    """An ``auto`` request's choice, before each step, between prompt lookup and its drafter.

    The drafter a request takes at admission keeps per-request state (a draft cache, an EAGLE
    cursor), so it holds for the request's life; prompt lookup keeps none beyond the request's
    tokens, so a request whose drafter drafts a chain (the draft model, EAGLE's chain) is offered
    both before every step and `specops.spec.chooser.choose` picks, by the rule and probe
    cadence `Decoder.generate(method="auto")` uses every step (`specops.spec.auto.STEP_RULE`), the
    one with more expected tokens per second of the step (`rate`). The drafter keeps up with the
    steps lookup ran: an EAGLE cursor is fed their rows (the target returns every row of such a
    sequence), a draft cache catches up in its next round.

    Each option keeps its own acceptance state (`Profile`), and lookup one per tier of its match's
    length, as the library's estimates are kept (`specops.spec.auto.NGRAM_TIERS`: a long match's
    continuation is accepted far deeper than a 1-token match's). The sequence carries the state and
    the settings (``spec.method``) of the option of the step being planned, so the rest of the step
    (grouping, verification, commit, acceptance updates) runs as for a request of that method."""

    def __init__(self, seq: Any, base: str, lookup_profile: Callable[[str], Profile], rule: ProbeRule) -> None:
        self.base = base
        self.current = base
        self.tier = "ngram"  # the lookup tier of the latest lookup step
        self.rule = rule
        self.lookup_profile = lookup_profile  # a tier's first acceptance state
        self.base_spec, self.lookup_spec = seq.spec, replace(seq.spec, method="ngram")
        self.profiles: dict[str, Profile] = {}
        self.clock = ChoiceClock()
        self.steps: dict[str, int] = seq.stats.auto_steps  # the steps each method was chosen for

    def switch(self, seq: Any, option: str) -> None:
        """Make ``option`` (the drafter, or a lookup tier) the sequence's method, with its acceptance state."""
        if option == self.current:
            return
        self.profiles[self.current] = Profile(seq.alpha, seq.acc_hits, seq.acc_trials, seq.accept_scale,
                                              seq.prior_key)
        p = self.profiles.pop(option, None) or self.lookup_profile(option)
        seq.alpha, seq.acc_hits, seq.acc_trials, seq.accept_scale, seq.prior_key = (
            p.alpha, p.acc_hits, p.acc_trials, p.accept_scale, p.prior_key)
        seq.spec = self.base_spec if option == self.base else self.lookup_spec
        if option != self.base:
            self.tier = option
        self.current = option

    def choose(self, rates: dict[str, float]) -> str:
        """The option of this step among those offering drafts (``rates``: expected tokens per second)."""
        picked = choose(rates, self.clock, self.rule) if len(rates) > 1 else next(iter(rates))
        self.clock.used(picked)
        method = self.base if picked == self.base else "ngram"
        self.steps[method] = self.steps.get(method, 0) + 1
        return picked


def rate(gains: list[float], step_s: Callable[[int], float]) -> float:
    """Expected tokens per second of a step that drafts the best number of an offer's tokens:
    ``gains`` the marginal expected accepted tokens of its 1st, 2nd, ... draft, ``step_s(k)`` the
    step's predicted seconds with k drafts."""
    best, tokens = 0.0, 1.0
    for k, g in enumerate(gains, 1):
        tokens += g
        best = max(best, tokens / max(step_s(k), 1e-9))
    return best
