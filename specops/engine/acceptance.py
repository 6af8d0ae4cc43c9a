"""Acceptance estimates of the serving engine's speculating sequences.

Per-token acceptance α of linear drafts (draft, n-gram, EAGLE) is accepted / trials, where a round's
trials are its accepted tokens plus the rejection that ended it early (positions after a
rejection are never tried, so accepted / drafted would read deep rounds as worse than they
are). A request's own counts decay by `SEQ_DECAY` per round and are shrunk toward its kind's
estimate (`AcceptancePriors`), worth `SEQ_PRIOR_TRIALS` trials; a sequence that stopped
speculating drifts back toward that estimate by `ALPHA_RECOVERY` per plain step, so it is
probed again later.
"""

from __future__ import annotations

ALPHA_PRIOR = {"draft": 0.7, "ngram": 0.6, "medusa": 0.7, "eagle": 0.7}
"""Per-token acceptance assumed for a kind never seen."""
EAGLE_TREE = "eagle_tree"
"""The kind of a greedy eagle request's EAGLE-2 trees, beside its method's: its own profile and
scale here, its own drafting overhead in the engine's plan."""
ALPHA_RECOVERY = 0.05
"""Per plain step, the share of the way back to its kind's estimate a sequence's α moves."""
PRIOR_WEIGHT = 0.05
"""Weight of one speculative step in its kind's Medusa scale (`AcceptancePriors.observe_scale`)."""
SEQ_DECAY = 0.8
"""Per speculative round, the decay of a request's own counts."""
SEQ_PRIOR_TRIALS = 2.0
"""Trials the kind's estimate counts as in a request's own α."""
KIND_DECAY = 0.97
"""Per speculative round, the decay of a kind's counts."""
KIND_PRIOR_TRIALS = 4.0
"""Trials `ALPHA_PRIOR` counts as in a kind's α."""
PROFILE_WEIGHT = 0.1
"""Weight of one drafted EAGLE-2 tree in its kind's profile (`AcceptancePriors.observe_profile`)."""


class AcceptancePriors:
    """What earlier requests of the same kind achieved: the starting point of a new request's
    acceptance estimates (and where a sequence that stopped speculating drifts back to).

    A kind is (request class — `SpecSettings.auto_key` —, method, sampled or greedy): a
    high-temperature class starts from its own low acceptance instead of paying several
    steps of wide, mostly rejected speculation first. A kind's α is its decayed accepted
    tokens over decayed trials (`KIND_DECAY` per round) with `ALPHA_PRIOR` worth
    `KIND_PRIOR_TRIALS` trials; its Medusa scale (accepted / the heads' accuracy table's
    expectation; an EAGLE-2 tree's: accepted / the drafter's own estimate) moves by `PRIOR_WEIGHT`
    per step toward what was measured; a kind never seen keeps the fixed prior. An EAGLE-2 tree
    kind also keeps its *profile*: the drafter's estimates of its trees' best nodes, by rank
    (`observe_profile`)."""

    def __init__(self) -> None:
        self._counts: dict[tuple, tuple[float, float]] = {}  # linear drafts: decayed (accepted, trials)
        self._positions: dict[tuple, list[list[float]]] = {}  # linear drafts: per position [hits, trials], decayed
        self._scale: dict[tuple, float] = {}  # Medusa: accepted / the accuracy table's expectation
        self._profile: dict[tuple, list[float]] = {}  # EAGLE-2 trees: the k-th best node's estimate, decayed
        self._tree: dict[tuple, tuple[float, float]] = {}  # EAGLE-2 trees: decayed (accepted, drafter's expected)

    def alpha(self, key: tuple, method: str) -> float:
        """Per-token acceptance of the kind's linear drafts (draft, ngram, eagle)."""
        prior = ALPHA_PRIOR.get(method, 0.0)
        hits, trials = self._counts.get(key, (0.0, 0.0))
        return (hits + KIND_PRIOR_TRIALS * prior) / (trials + KIND_PRIOR_TRIALS)

    def scale(self, key: tuple) -> float:
        return self._scale.get(key, 1.0)

    def observe_alpha(self, key: tuple, accepted: int, trials: int) -> None:
        """One linear round of the kind: ``accepted`` tokens in ``trials`` (module docstring)."""
        hits, total = self._counts.get(key, (0.0, 0.0))
        self._counts[key] = (KIND_DECAY * hits + accepted, KIND_DECAY * total + trials)
        cells = self._positions.setdefault(key, [])
        cells.extend([0.0, 0.0] for _ in range(trials - len(cells)))
        for i, cell in enumerate(cells):  # positions 0..trials-1 were tried, the first `accepted` accepted
            cell[0] = KIND_DECAY * cell[0] + (i < accepted)
            cell[1] = KIND_DECAY * cell[1] + (i < trials)

    def gains(self, key: tuple, method: str, alpha: float, bound: int) -> list[float]:
        """Expected acceptance of a linear draft's 1st..bound-th token for a sequence whose own
        per-token acceptance is ``alpha``: the kind's acceptance at each position, given the ones
        before were accepted (shrunk toward the kind's α, `KIND_PRIOR_TRIALS` trials' worth; a
        position never reached reads as the deepest one that was), relative to the kind's α.

        Conditional acceptance falls with depth (more steeply at high temperature), so a
        constant α^k would overstate deep tokens and buy drafts that are rejected."""
        kind = self.alpha(key, method)
        if kind <= 0.0:
            return [0.0] * bound
        cells = self._positions.get(key, [])
        out, p, q = [], 1.0, kind
        for i in range(bound):
            if i < len(cells):
                hits, trials = cells[i]
                q = (hits + KIND_PRIOR_TRIALS * q) / (trials + KIND_PRIOR_TRIALS)  # toward the one before
            p *= min(alpha * q / kind, 0.99)
            out.append(p)
        return out

    def observe_scale(self, key: tuple, value: float) -> None:
        a = self.scale(key)
        self._scale[key] = a + PRIOR_WEIGHT * (value - a)

    def profile(self, key: tuple) -> list[float] | None:
        """What the drafter estimated of the k-th best node of the kind's recent trees (the chance
        the target accepts it: `eagle_tree.draft_tree`'s ``estimates``), best first and never
        increasing; None before the kind drafted a tree."""
        values = self._profile.get(key)
        if values is None:
            return None
        out, low = [], 1.0
        for v in values:  # an entry appended from a longer tree may top the blended one before it
            low = min(low, v)
            out.append(low)
        return out

    def observe_profile(self, key: tuple, estimates: list[float]) -> None:
        """One tree's ``estimates`` (best first): each rank moves `PROFILE_WEIGHT` of the way toward
        it; ranks the kind has not seen yet take it as it is."""
        values = self._profile.setdefault(key, [])
        for i, e in enumerate(estimates):
            if i < len(values):
                values[i] += PROFILE_WEIGHT * (e - values[i])
            else:
                values.append(e)

    def tree_scale(self, key: tuple) -> float:
        """What an EAGLE-2 tree kind's trees accepted per token the drafter expected of them (its
        decayed sums, `KIND_DECAY` per tree; the drafter's word, 1.0, worth `KIND_PRIOR_TRIALS`
        expected tokens). A ratio of sums, not a mean of ratios: a tree the drafter expected
        almost nothing of and that had a token accepted weighs what it expected."""
        accepted, expected = self._tree.get(key, (0.0, 0.0))
        return (accepted + KIND_PRIOR_TRIALS) / (expected + KIND_PRIOR_TRIALS)

    def observe_tree(self, key: tuple, accepted: int, expected: float) -> None:
        """One verified tree of the kind: ``accepted`` tokens where the drafter expected ``expected``."""
        a, e = self._tree.get(key, (0.0, 0.0))
        self._tree[key] = (KIND_DECAY * a + accepted, KIND_DECAY * e + expected)
