"""How big a Medusa tree should be: measured verify cost against expected acceptance.

A bigger tree accepts more tokens per verification but makes the verification
forward slower; on a CPU in fp32 a forward over 8 positions costs roughly twice one
position. ``measure_verify_cost`` times the actual runner at startup (a forward over
T tree positions on top of a prefix, for several T) into a ``VerifyCostCurve``;
``tree_options`` lists, for every tree size n, the sparse tree of
`specops.spec.tree.ranked_nodes`, and ``choose_tree`` keeps the n that maximises

    expected tokens per step / (verify_cost(n) + per-step overhead)

where the per-step overhead (running the heads, building the tree) is measured too.

That startup curve is only a prior. The host a runner lives on changes under it: on the
reference machine a T = 1 forward took 0.98 ms in one run and 2.03 ms in the next, with
c(8)/c(1) 1.55 and 1.33, and a curve timed once said 8 positions cost what 1 does in one
state while 16 nodes lost 20% to 4 in the other. `TreePlanner` therefore keeps, per runner
and heads, the measured seconds of whole decoding steps (heads, tree forward, walk, KV
compaction: everything a step costs) per tree size, starts from the curve, and picks each
step's size from those live costs, trying a neighbouring size now and then so a size
that got cheaper is noticed.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from specops.spec.clock import cost_clock
from specops.models.medusa_heads import HeadsLike, head_candidates
from specops.models.runner import ModelRunner
from specops.spec.tree import TreeError, TreeSpec, make_spec, preset, ranked_nodes

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class VerifyCostCurve:
    """Seconds of one target forward over T new positions, measured at several T."""

    sizes: tuple[int, ...]  # ascending T values, first one 1
    seconds: tuple[float, ...]  # seconds per forward at each size
    how: str = "forward"  # what was timed: "forward", or "one C call" (`measure_verify_cost(one_call=True)`)

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError("VerifyCostCurve needs one timing per size and at least one size")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] != 1:
            raise ValueError(f"sizes must be ascending, unique and start at 1, got {self.sizes}")
        if any(s <= 0 for s in self.seconds):
            raise ValueError(f"timings must be positive, got {self.seconds}")

    def at(self, n: int) -> float:
        """Seconds for a forward over n positions (linear between and beyond measurements)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        xs, ys = self.sizes, self.seconds
        if len(xs) == 1:
            return ys[0] * n
        for i in range(1, len(xs)):
            if n <= xs[i] or i == len(xs) - 1:
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                return max(ys[0], y0 + (y1 - y0) * (n - x0) / (x1 - x0))
        raise AssertionError("unreachable")

    def relative(self, n: int) -> float:
        """Cost of n positions relative to one."""
        return self.at(n) / self.at(1)


def measure_verify_cost(runner, *, sizes: Sequence[int] = DEFAULT_SIZES, prefix_len: int = 64,
                        repeats: int = 7, vocab_high: int | None = None, seed: int = 0,
                        one_call: bool = False) -> VerifyCostCurve:
    """Time ``runner.forward`` over T chain-shaped tree positions after a ``prefix_len`` prefix.

    Sizes are timed round-robin and each keeps the fastest of ``repeats`` runs (the
    least disturbed by other work on the machine); the curve is made non-decreasing.
    Leaves the runner's cache empty (it resets before and after). ``one_call``: where the
    runner verifies greedy blocks in one C call (`FastLlamaRunner.block_verifier`, what
    greedy decoding runs), time that call over the T positions instead; `forward` also pays
    its Python around the same C forward (~0.25–0.3 ms on the bundled target), which
    makes c(T)/c(1) look flatter than what greedy decoding pays.
    """
    sizes = sorted(set(int(s) for s in sizes) | {1})
    prefix_len = max(1, min(prefix_len, runner.max_context - sizes[-1]))
    if prefix_len + sizes[-1] > runner.max_context:
        raise ValueError(f"runner context {runner.max_context} too small to time trees of {sizes[-1]} positions")
    gen = torch.Generator().manual_seed(seed)
    high = vocab_high or runner.vocab_size
    runner.reset(1)
    prefix = torch.randint(0, high, (1, prefix_len), generator=gen).to(runner.device)  # [1, L]
    runner.forward(prefix)
    inputs = []
    for n in sizes:
        ids = torch.randint(0, high, (1, n), generator=gen).to(runner.device)  # [1, n]
        mask = torch.ones(n, n, dtype=torch.bool, device=runner.device).tril()  # [n, n]
        positions = (prefix_len + torch.arange(n, device=runner.device))[None]  # [1, n]
        inputs.append((ids, mask, positions))
    clock = cost_clock(runner.device)
    make = getattr(runner, "block_verifier", None) if one_call else None
    block = make() if make is not None else None
    if block is not None and not all(block.applies(n) for n in sizes):
        block = None
    best = [float("inf")] * len(sizes)
    for rep in range(repeats + 1):  # sizes interleaved, so drifting load hits all of them alike
        for i, (ids, mask, positions) in enumerate(inputs):
            start = clock()
            if block is not None:
                block.verify(ids[0].tolist())
            else:
                runner.forward(ids, position_ids=positions, tree_mask=mask, need_hidden=True)
            elapsed = clock() - start
            runner.truncate(prefix_len)
            if rep:  # the first round warms caches and allocators
                best[i] = min(best[i], elapsed)
    timings = best
    runner.reset(1)
    # A bigger forward never costs less; noise from other processes can make it look so.
    monotone = [max(timings[: i + 1]) for i in range(len(timings))]
    curve = VerifyCostCurve(sizes=tuple(sizes), seconds=tuple(max(t, 1e-9) for t in monotone),
                            how="one C call" if block is not None else "forward")
    logger.info("verify cost curve (relative to 1 position): %s",
                ", ".join(f"{n}:{curve.relative(n):.2f}" for n in sizes))
    return curve


@dataclass(frozen=True)
class TreeChoice:
    """A sparse tree of one size (`tree_options`), what it is expected to emit and cost."""

    spec: TreeSpec
    expected_tokens: float  # expected tokens emitted per verification step (greedy estimate)
    step_seconds: float  # verify cost + overhead of one step at this size
    tokens_per_s: float  # expected_tokens / step_seconds


def tree_options(accuracy: Sequence[Sequence[float]], cost: VerifyCostCurve, *, overhead_s: float = 0.0,
                 max_nodes: int | None = None) -> list[TreeChoice]:
    """The sparse tree of every size 1 .. max_nodes (or as many nodes as the accuracy table
    ranks), each with its expected tokens per step and its seconds under ``cost``."""
    limit = max_nodes if max_nodes is not None else cost.sizes[-1]
    if limit < 1:
        raise TreeError(f"max_nodes must be >= 1, got {limit}")
    ranked = ranked_nodes(accuracy, limit)
    options: list[TreeChoice] = []
    expected = 1.0  # the root's successor (bonus token) always comes out
    for n in range(1, len(ranked) + 2):
        if n > 1:
            expected += ranked[n - 2][1]
        seconds = cost.at(n) + overhead_s
        options.append(TreeChoice(spec=make_spec([p for p, _ in ranked[: n - 1]], name=f"sparse{n}"),
                                  expected_tokens=expected, step_seconds=seconds, tokens_per_s=expected / seconds))
    return options


def choose_tree(accuracy: Sequence[Sequence[float]], cost: VerifyCostCurve, *, overhead_s: float = 0.0,
                max_nodes: int | None = None) -> TreeChoice:
    """The sparse tree size that maximises expected tokens per second (the smallest on a tie)."""
    best: TreeChoice | None = None
    for option in tree_options(accuracy, cost, overhead_s=overhead_s, max_nodes=max_nodes):
        if best is None or option.tokens_per_s > best.tokens_per_s * (1 + 1e-9):
            best = option
    assert best is not None
    return best


# -- the tree for a runner and its heads, planned once and kept ----------------------------
_COST_CURVES: "weakref.WeakKeyDictionary[object, VerifyCostCurve]" = weakref.WeakKeyDictionary()


def verify_cost_curve(target: ModelRunner) -> VerifyCostCurve:
    """The runner's verify-cost curve, measured on first use and kept for the runner's lifetime."""
    curve = _COST_CURVES.get(target)
    if curve is None:
        curve = measure_verify_cost(target, sizes=[s for s in DEFAULT_SIZES if s < target.max_context // 2] or [1])
        _COST_CURVES[target] = curve
    return curve


_HEADS_COSTS: "weakref.WeakKeyDictionary[object, dict[tuple[int, int], float]]" = weakref.WeakKeyDictionary()


def heads_overhead_s(heads: HeadsLike, target: ModelRunner, num_heads: int, repeats: int = 5) -> float:
    """Seconds of one proposal (fastest of ``repeats``): the heads on one hidden state plus their
    top-k; measured once per (heads, runner, number of heads) and kept."""
    try:
        per_heads = _HEADS_COSTS.setdefault(heads, {})
    except TypeError:  # heads that cannot be weakly referenced: measured every time
        per_heads = {}
    key = (id(target), num_heads)
    if key not in per_heads:
        per_heads[key] = _measure_heads(heads, target, num_heads, repeats)
    return per_heads[key]


def _measure_heads(heads: HeadsLike, target: ModelRunner, num_heads: int, repeats: int) -> float:
    hidden_size = getattr(getattr(heads, "config", None), "hidden_size", None)
    if hidden_size is None:
        return 0.0
    hidden = torch.zeros(hidden_size, device=target.device, dtype=target.dtype)  # [E]
    root = torch.zeros((), dtype=torch.long)
    samples = []
    clock = cost_clock(target.device)
    for _ in range(repeats + 1):
        t0 = clock()
        head_candidates(heads, hidden, num_heads, 4, root)  # what a proposal runs
        samples.append(clock() - t0)
    return min(samples[1:])


def plan_tree(target: ModelRunner, heads: HeadsLike, num_heads: int, max_nodes: int | None = None) -> TreeSpec:
    """The tree for ``tree=None``: the sparse tree from the heads' measured accuracy whose size
    maximises expected tokens/s under the runner's measured costs (the `TreePlanner`'s current
    choice); "small" when the heads carry no accuracy table. ``max_nodes`` bounds its node
    count (root included)."""
    planner = tree_planner(target, heads, num_heads, max_nodes)
    if planner is None:
        small = preset("small", num_heads)
        return small if max_nodes is None else small.limit(max_nodes=max_nodes)
    return planner.best()


PLANNER_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)  # tree sizes the live planner chooses among
EXPLORE_EVERY = 16  # one step in this many tries a size next to the best one
COST_EMA = 0.1  # weight of a new step time in the running cost of the size in use
EXPLORED_WEIGHT = 0.5  # ... and in that of a size only tried now and then


class TreePlanner:
    """Each step's tree size from live step times (module docstring).

    ``cost[n]`` starts as the startup curve's verify cost plus the heads' overhead and moves
    to the measured seconds of whole steps with n nodes (an exponential average, weighted
    more towards new timings for the sizes only explored); ``best``
    maximises expected tokens / cost[n]; ``next_spec`` returns it, or every EXPLORE_EVERY-th
    step a neighbouring size (alternately smaller and larger). Trees and their priors are
    `tree_options`' (the sparse trees of the heads' accuracy table). One planner serves every
    request of a (runner, heads, number of heads, bound); not thread-safe beyond the GIL's per-operation
    atomicity (a lost update only delays learning)."""

    def __init__(self, accuracy: Sequence[Sequence[float]], curve: VerifyCostCurve, *, overhead_s: float,
                 max_nodes: int | None = None, sizes: Sequence[int] = PLANNER_SIZES) -> None:
        limit = min(max_nodes if max_nodes is not None else curve.sizes[-1], max(sizes))
        options = {o.spec.num_nodes: o for o in tree_options(accuracy, curve, overhead_s=overhead_s,
                                                               max_nodes=limit)}
        self.sizes = tuple(n for n in sorted(set(sizes)) if n in options) or (1,)
        self.specs = {n: options[n].spec for n in self.sizes}
        self.expected = {n: options[n].expected_tokens for n in self.sizes}
        self.cost = {n: options[n].step_seconds for n in self.sizes}
        self.samples = {n: 0 for n in self.sizes}
        self.steps = 0

    def best_size(self) -> int:
        return max(self.sizes, key=lambda n: (self.expected[n] / self.cost[n], -n))

    def best(self) -> TreeSpec:
        return self.specs[self.best_size()]

    def next_spec(self) -> TreeSpec:
        """The tree for the next step: the best size, or now and then a neighbour of it."""
        self.steps += 1
        n = self.best_size()
        if self.steps % EXPLORE_EVERY == 0 and len(self.sizes) > 1:
            i = self.sizes.index(n)
            step = -1 if (self.steps // EXPLORE_EVERY) % 2 else 1
            j = i + step if 0 <= i + step < len(self.sizes) else i - step
            n = self.sizes[j]
        return self.specs[n]

    def observe(self, nodes: int, seconds: float) -> None:
        """A whole step over a tree of ``nodes`` nodes (one of `sizes`) took ``seconds``."""
        if nodes not in self.cost or not seconds > 0:
            return
        self.samples[nodes] += 1
        if self.samples[nodes] == 1:
            weight = 1.0  # the first measurement replaces the prior
        elif nodes == self.best_size():
            weight = COST_EMA
        else:  # an explored size: its last timing may be long stale, so a rare new one counts more
            weight = EXPLORED_WEIGHT
        self.cost[nodes] += weight * (seconds - self.cost[nodes])


_PLANNERS: "weakref.WeakKeyDictionary[object, dict[tuple[int, int, int | None], TreePlanner]]" = \
    weakref.WeakKeyDictionary()


def tree_planner(target: ModelRunner, heads: HeadsLike, num_heads: int,
                 max_nodes: int | None = None) -> TreePlanner | None:
    """The live planner of (runner, heads, number of heads, bound), made on first use from the
    runner's measured verify-cost curve and the heads' overhead; None when the heads carry no
    accuracy table (then the "small" preset is used)."""
    accuracy = getattr(getattr(heads, "config", None), "head_topk_accuracy", None)
    if not accuracy:
        return None
    try:
        planners = _PLANNERS.setdefault(heads, {})
    except TypeError:  # heads that cannot be weakly referenced: a planner per call
        planners = {}
    key = (id(target), num_heads, max_nodes)
    if key not in planners:
        curve = verify_cost_curve(target)
        cap = None if max_nodes is None else min(max_nodes, curve.sizes[-1])
        planner = TreePlanner(accuracy[:num_heads], curve, max_nodes=cap,
                              overhead_s=heads_overhead_s(heads, target, num_heads))
        planners[key] = planner
        n = planner.best_size()
        logger.info("medusa tree for %d heads: starts at %d nodes (%.2f expected tokens/step), adapts to step times",
                    num_heads, n, planner.expected[n])
    return planners[key]
