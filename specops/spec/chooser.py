"""The one rule of ``method="auto"``: which speculation option runs next, from running estimates.

Its callers, each with the estimates it can measure:

* `Decoder.generate(method="auto")` (`specops.spec.auto`) every step: its options are
  plain decoding, n-gram, the draft model, Medusa and EAGLE, rated in expected tokens per
  modelled second of this step;
* the serving engine every step of an ``auto`` request on a chain drafter
  (`specops.engine.auto_method.StepChoice`): n-gram or that drafter, rated in expected tokens
  per second of the step the planner models, with the library's probe rule;
* the serving engine at each admission of an ``auto`` request (`specops.engine.auto_method`):
  the drafters that keep per-request state (KV caches, drafter state) are chosen for the
  request's life, rated in tokens per target forward of the requests of the same kind that
  ran them.

The rule (`choose`): an option never measured is tried first, in turn; otherwise the best
rate runs, and a worse option is tried again once it is due: ``wait`` choices after its last
one, with ``wait = clamp(loss / budget, every, max_wait)`` where ``loss`` is the share of a
choice's worth that a try of it is expected to lose (the best rate over its own, read at its
hopeful rate where the caller has one, minus 1). So tries of worse options cost at most
``budget`` of the time, an estimate that looked bad on little evidence is measured again soon,
and none goes unmeasured for more than ``max_wait`` choices (traffic changes; an estimate
goes stale).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProbeRule:
    """How often a worse-looking option is tried again (see the module docstring)."""

    every: int
    """Choices between two tries of one option at the least (an option as good as the best)."""
    budget: float
    """Share of the time tries of one worse option may cost."""
    max_wait: int
    """No option waits longer than this many choices for its next try."""

    def __post_init__(self) -> None:
        if not 1 <= self.every <= self.max_wait or not 0.0 < self.budget <= 1.0:
            raise ValueError(f"a probe rule needs 1 <= every <= max_wait and 0 < budget <= 1, got {self}")

    def wait(self, best_rate: float, hoped_rate: float) -> float:
        """Choices an option rated ``hoped_rate`` waits between tries while the best runs at ``best_rate``."""
        loss = best_rate / max(hoped_rate, 1e-12) - 1.0  # a try's time lost, in choices of the best
        return min(max(float(self.every), loss / self.budget), float(self.max_wait))


@dataclass
class ChoiceClock:
    """The choices counted and each option's last one, kept across requests: tries of a worse
    option come every ``every``..``max_wait`` choices of the chooser's life, not of one request
    (a request shorter than ``every`` steps would never try one, and a bad early estimate would
    then stand for good)."""

    step: int = 0
    last_used: dict[str, int] = field(default_factory=dict)

    def used(self, option: str) -> None:
        """Note that ``option`` ran at the current choice."""
        self.last_used[option] = self.step


def choose(rates: Mapping[str, float], clock: ChoiceClock, rule: ProbeRule, *, untried: Sequence[str] = (),
           hoped: Callable[[str], float] | None = None, fixed_wait: Mapping[str, int] | None = None) -> str:
    """The option of the next choice (counts it on ``clock``; the caller notes the one that ran
    with `ChoiceClock.used`). ``rates``: each available option's expected rate (non-empty);
    ``untried``: options without a trusted estimate yet, tried first, in turn; ``hoped``: an
    option's rate at its upper bound, which sets how soon it is tried again (default: its rate);
    ``fixed_wait``: options with a wait of their own (one with nothing to learn but its cost)."""
    if not rates:
        raise ValueError("auto needs at least one option to choose from")
    clock.step += 1
    if untried:
        return untried[clock.step % len(untried)]
    best = max(rates, key=rates.__getitem__)
    for option, rate in rates.items():
        since = clock.step - clock.last_used.get(option, 0)
        if option == best or since < rule.every:
            continue  # the best, or not due whatever it costs (every wait is >= every)
        wait = (fixed_wait or {}).get(option)
        if wait is None:
            wait = rule.wait(rates[best], rate if hoped is None else hoped(option))
        if since >= wait:
            return option
    return best
