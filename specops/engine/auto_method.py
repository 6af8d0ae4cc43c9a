"""``method="auto"`` in the serving engine: which speculation a request runs, from live results.

`Decoder.generate(method="auto")` switches drafter step by step inside one request
(`specops.spec.auto`). In the engine a request keeps one proposer for its life (its
KV caches and proposal state are per method), so ``auto`` is decided at admission, by the
same rule (`specops.spec.chooser.choose`) over what the engine can measure: it keeps one
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

from dataclasses import dataclass, field

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
