"""Step-time accounting of the serving engine: the planner's measured overheads and the speed-up estimate.

`StepAccounts` turns each step's timings into what the planner charges beyond the forwards:
each speculating kind's per-sequence overhead (its share of the step's proposals plus the
verification and commit time it took beyond a plain sequence's; EAGLE-2 trees apart from eagle
chains) and the step's fixed host time per batch size. It keeps this step's proposal seconds
(n-gram and prompt-lookup branch lookups, draft rounds, Medusa trees) and each request's share
of them, counts the steps that emitted tokens (all plain, or some sequence speculated), and
feeds every request's speed-up estimate (`speedup_estimate.PlainTimeEstimate`).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from specops.engine.acceptance import ALPHA_PRIOR, EAGLE_TREE
from specops.engine.sequence import Sequence
from specops.engine.speedup_estimate import PlainTimeEstimate
from specops.engine.spec_planner import Meter

PLAIN_STEP_WINDOW = 64  # plain steps per batch size behind the speed-up estimate of batched requests


def overhead_kind(seq: Sequence) -> str:
    """Whose measured overhead a speculating sequence's is: its method's, EAGLE-2 trees' apart."""
    return EAGLE_TREE if seq.eagle is not None and seq.eagle.shape is not None else seq.spec.method


class StepAccounts:
    """The engine's overhead meters, proposal time, decode-step counts and plain-time estimate.

    ``cost``: the engine's verify `CostModel`, looked up per call (a test may swap it); the
    speed-up estimate scales a plain step measured at another batch size by it."""

    def __init__(self, cost: Callable[[], Any]) -> None:
        self.cost = cost
        # per speculating sequence, outside the forwards; per method, and EAGLE-2 trees apart from eagle chains
        self.overhead: dict[str, Meter] = {m: Meter() for m in (*ALPHA_PRIOR, EAGLE_TREE)}
        self.fixed: dict[int, Meter] = {}  # per batch size: the step's host time outside forwards and proposals
        self._plain_commit = Meter()  # verification + commit of a plain decoding step, per sequence
        # the speed-up estimate (`speedup_estimate`): per batch size, wall seconds of the last
        # PLAIN_STEP_WINDOW steps where all decoded plainly (their mean: it stands in for a sum of such steps)
        self.plain_time = PlainTimeEstimate(PLAIN_STEP_WINDOW)
        self.plain_step: dict[int, deque[float]] = self.plain_time.windows
        self.decode_steps = [0, 0]  # steps that emitted tokens: [all plain, some sequence speculated]
        self.propose_s = 0.0  # this step's proposal seconds (n-gram lookups, draft rounds, Medusa trees)
        self.propose_share: dict[str, float] = {}  # request -> its share of them, beyond the draft forwards
        self.lookup_s: dict[str, float] = {}  # request -> its n-gram lookup this step (a draft, a Medusa branch)

    # -- this step's proposals ---------------------------------------------------------
    def start_step(self) -> None:
        """A step begins: no proposal time yet."""
        self.propose_s = 0.0

    def start_plan(self) -> None:
        """The step's plan begins: no request's lookup or proposal share yet."""
        self.lookup_s, self.propose_share = {}, {}

    def note_lookup(self, request_id: str, seconds: float) -> None:
        """A request's n-gram lookup (timed with the cheap wall clock): its own and the step's proposal time."""
        self.lookup_s[request_id] = seconds
        self.propose_s += seconds

    def note_proposal(self, seconds: float) -> None:
        """One method's proposer call for its group of sequences."""
        self.propose_s += seconds

    def note_share(self, request_id: str, share_s: float) -> None:
        """A request's share of its group's proposal, with its n-gram lookup (an n-gram draft, a Medusa branch)."""
        self.propose_share[request_id] = share_s + self.lookup_s.get(request_id, 0.0)

    # -- the planner's meters --------------------------------------------------------
    def overhead_s(self, seq: Sequence) -> float:
        """The measured per-sequence overhead the plan charges ``seq`` (`overhead_kind`)."""
        return self.overhead[overhead_kind(seq)].value()

    def measure_overheads(self, b: int, host_s: float, plain_commit: list[float],
                          spec_commit: list[tuple[Sequence, float]]) -> None:
        """Feed the planner's meters: each speculating sequence's proposal plus the verification
        time it took beyond a plain sequence's; the rest of the step's host time is fixed cost."""
        if plain_commit:
            self._plain_commit.observe(sorted(plain_commit)[len(plain_commit) // 2])
        plain = self._plain_commit.value()
        extra = 0.0
        by_method: dict[str, list[float]] = {}
        for seq, spent in spec_commit:
            share = self.propose_share.get(seq.request_id, 0.0)
            by_method.setdefault(overhead_kind(seq), []).append(share + max(spent - plain, 0.0))
            extra += max(spent - plain, 0.0)
        for method, values in by_method.items():
            self.overhead[method].observe(sorted(values)[len(values) // 2])
        self.fixed.setdefault(b, Meter()).observe(max(host_s - self.propose_s - extra, 0.0))

    def fixed_s(self, b: int) -> float:
        """The step's fixed host time at batch size ``b``: the nearest measured size's, scaled to ``b``."""
        if not self.fixed:
            return 0.0
        near = min(self.fixed, key=lambda x: (abs(x - b), x))
        return self.fixed[near].value() * b / near  # host time grows with the batch

    # -- decode steps and the speed-up estimate ------------------------------------------
    def count_step(self, speculated: bool) -> None:
        """A step that emitted tokens: all plain, or some sequence speculated."""
        self.decode_steps[speculated] += 1

    def count_plain_time(self, b: int, step_s: float, emitted: list[tuple[Sequence, int]], speculated: bool,
                         prefilled: bool, spec_s: float = 0.0) -> None:
        """The speed-up estimate of batched requests (`PlainTimeEstimate.count`); ``spec_s``: the
        step's speculation work in wall seconds. (A request that finished in this step has its wall
        time already closed: the rest of the step's commits count on the plain side too.)"""
        self.plain_time.count(b, step_s, emitted, speculated=speculated, prefilled=prefilled, spec_s=spec_s,
                              cost=self.cost())
