"""How big a Medusa tree should be: measured verify cost against expected acceptance.

A bigger tree accepts more tokens per verification but makes the verification
forward slower; on a CPU in fp32 a forward over 8 positions costs roughly twice one
position. ``measure_verify_cost`` times the actual runner at startup (a forward over
T tree positions on top of a prefix, for several T) into a ``VerifyCostCurve``;
``choose_tree`` then takes, over every tree size n, the sparse tree of
`specops.decoder.tree.ranked_nodes` and keeps the n that maximises

    expected tokens per step / (verify_cost(n) + per-step overhead)

where the per-step overhead (running the heads, building the tree) is measured too.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from specops.decoder.clock import cost_clock
from specops.decoder.medusa_heads import HeadsLike
from specops.decoder.runner import ModelRunner
from specops.decoder.tree import TreeError, TreeSpec, make_spec, preset, ranked_nodes

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class VerifyCostCurve:
    """Seconds of one target forward over T new positions, measured at several T."""

    sizes: tuple[int, ...]  # ascending T values, first one 1
    seconds: tuple[float, ...]  # seconds per forward at each size

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
                        repeats: int = 7, vocab_high: int | None = None, seed: int = 0) -> VerifyCostCurve:
    """Time ``runner.forward`` over T chain-shaped tree positions after a ``prefix_len`` prefix.

    Sizes are timed round-robin and each keeps the fastest of ``repeats`` runs (the
    least disturbed by other work on the machine); the curve is made non-decreasing.
    Leaves the runner's cache empty (it resets before and after).
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
    best = [float("inf")] * len(sizes)
    for rep in range(repeats + 1):  # sizes interleaved, so drifting load hits all of them alike
        for i, (ids, mask, positions) in enumerate(inputs):
            start = clock()
            runner.forward(ids, position_ids=positions, tree_mask=mask, need_hidden=True)
            elapsed = clock() - start
            runner.truncate(prefix_len)
            if rep:  # the first round warms caches and allocators
                best[i] = min(best[i], elapsed)
    timings = best
    runner.reset(1)
    # A bigger forward never costs less; noise from other processes can make it look so.
    monotone = [max(timings[: i + 1]) for i in range(len(timings))]
    curve = VerifyCostCurve(sizes=tuple(sizes), seconds=tuple(max(t, 1e-9) for t in monotone))
    logger.info("verify cost curve (relative to 1 position): %s",
                ", ".join(f"{n}:{curve.relative(n):.2f}" for n in sizes))
    return curve


@dataclass(frozen=True)
class TreeChoice:
    """The tree ``choose_tree`` picked, and why."""

    spec: TreeSpec
    expected_tokens: float  # expected tokens emitted per verification step (greedy estimate)
    step_seconds: float  # verify cost + overhead of one step at this size
    tokens_per_s: float  # expected_tokens / step_seconds


def choose_tree(accuracy: Sequence[Sequence[float]], cost: VerifyCostCurve, *, overhead_s: float = 0.0,
                max_nodes: int | None = None) -> TreeChoice:
    """The sparse tree size that maximises expected tokens per second."""
    limit = max_nodes if max_nodes is not None else cost.sizes[-1]
    if limit < 1:
        raise TreeError(f"max_nodes must be >= 1, got {limit}")
    ranked = ranked_nodes(accuracy, limit)
    best: TreeChoice | None = None
    expected = 1.0  # the root's successor (bonus token) always comes out
    for n in range(1, len(ranked) + 2):
        if n > 1:
            expected += ranked[n - 2][1]
        seconds = cost.at(n) + overhead_s
        rate = expected / seconds
        if best is None or rate > best.tokens_per_s * (1 + 1e-9):
            best = TreeChoice(spec=make_spec([p for p, _ in ranked[: n - 1]], name=f"sparse{n}"),
                              expected_tokens=expected, step_seconds=seconds, tokens_per_s=rate)
    assert best is not None
    return best


# -- the tree for a runner and its heads, planned once and kept ----------------------------
_COST_CURVES: "weakref.WeakKeyDictionary[object, VerifyCostCurve]" = weakref.WeakKeyDictionary()
_PLANS: "weakref.WeakKeyDictionary[object, dict[tuple[int, int, int | None], TreeChoice]]" = weakref.WeakKeyDictionary()


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
    samples = []
    clock = cost_clock(target.device)
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = clock()
            torch.topk(heads(hidden, num_heads), 4, dim=-1)
            samples.append(clock() - t0)
    return min(samples[1:])


def plan_tree(target: ModelRunner, heads: HeadsLike, num_heads: int, max_nodes: int | None = None) -> TreeSpec:
    """The tree for ``tree=None``: the sparse tree from the heads' measured accuracy whose size
    maximises expected tokens/s under the runner's measured verify cost; "small" when the
    heads carry no accuracy table. ``max_nodes`` bounds its node count (root included)."""
    accuracy = getattr(getattr(heads, "config", None), "head_topk_accuracy", None)
    if not accuracy:
        small = preset("small", num_heads)
        return small if max_nodes is None else small.limit(max_nodes=max_nodes)
    plans = _PLANS.setdefault(heads, {})
    key = (id(target), num_heads, max_nodes)
    if key not in plans:
        curve = verify_cost_curve(target)
        cap = None if max_nodes is None else min(max_nodes, curve.sizes[-1])
        plans[key] = choose_tree(accuracy[:num_heads], curve, max_nodes=cap,
                                 overhead_s=heads_overhead_s(heads, target, num_heads))
        choice = plans[key]
        logger.info("medusa tree for %d heads: %d nodes, %.2f expected tokens/step, %.0f tokens/s expected",
                    num_heads, choice.spec.num_nodes, choice.expected_tokens, choice.tokens_per_s)
    return plans[key].spec
