"""Load-aware speculation: per step, how much each sequence speculates.

The cost of a verification forward depends on the whole batch: B sequences feeding T
tokens in all. At batch 1 a forward over 5 tokens costs little more than over 1 (the
weights are read once either way), so drafting 4 tokens is almost free; at batch 16
the same forward is already compute-heavy and every extra drafted token costs real
time that a rejected draft wastes for everyone in the batch.

`CostModel` measures this: it keeps the observed seconds of target forwards per exact
(B, T) (a running mean) and predicts from one least-squares line in T per batch size. The engine seeds it with a short calibration at start-up
and keeps feeding it every real step, so it follows the machine's actual load.

`plan` then chooses, for every speculating sequence, how many speculative tokens it
feeds (γ for a linear draft, extra nodes for a Medusa tree) within its `SpecSettings`
bound, to maximise the expected batch goodput

    (B + sum of the expected accepted tokens of the chosen drafts)
    / (cost(B, T_plain + drafted tokens) + draft-model rounds * seconds per round).

Each sequence offers marginal gains that never increase (the k-th drafted token of a
linear draft is accepted with probability alpha^k; a tree's k-th best node with its
path's estimated probability), so the plan takes the best gains of all sequences
together, in order, and keeps the prefix with the highest goodput. When the batch is
large or acceptance low the best prefix is short or empty: speculation shrinks or
switches off by itself, and comes back when the batch drains.

How this differs from vLLM's static table (``num_speculative_tokens`` with a per
batch-size cutoff, ``speculative_disable_by_batch_size``): that table is written by hand
for one model and one machine and applies one γ to every request. Here the cost is
measured on the running machine (and keeps being measured), the acceptance is each
request's own running estimate, and every sequence gets its own γ or tree size.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


class CostModel:
    """Seconds of one forward as a function of (batch size B, total new tokens T).

    Observations are running means per exact (B, T). Predictions come from a straight
    line in T per observed batch size (least squares, slope >= 0: a bigger forward never
    costs less, whatever the noise), interpolated linearly between the two nearest
    observed batch sizes. One line per B keeps what matters for planning: at B = 1 extra
    tokens are nearly free, at B = 16 they are not.
    """

    def __init__(self, decay: float = 0.2, refit_every: int = 32) -> None:
        self.decay = decay
        self.refit_every = refit_every
        self.points: dict[tuple[int, int], float] = {}
        self._lines: dict[int, tuple[float, float]] | None = None  # B -> (intercept, slope per token)
        self._since_fit = 0

    def observe(self, b: int, t: int, seconds: float) -> None:
        if seconds <= 0:
            return
        old = self.points.get((b, t))
        self.points[(b, t)] = seconds if old is None else (1 - self.decay) * old + self.decay * seconds
        self._since_fit += 1
        if old is None or self._since_fit >= self.refit_every:
            self._lines = None  # refit at every new point, else every refit_every observations

    def _fit(self) -> dict[int, tuple[float, float]]:
        if self._lines is None:
            self._since_fit = 0
            by_b: dict[int, list[tuple[int, float]]] = {}
            for (b, t), sec in self.points.items():
                by_b.setdefault(b, []).append((t, sec))
            lines = {}
            for b, pts in by_b.items():
                ts = torch.tensor([float(t) for t, _ in pts], dtype=torch.float64)  # [P]
                ys = torch.tensor([sec for _, sec in pts], dtype=torch.float64)  # [P]
                if len(pts) < 2 or float(ts.max() - ts.min()) == 0.0:
                    lines[b] = (float(ys.mean()), 0.0)
                    continue
                slope = float(((ts - ts.mean()) * (ys - ys.mean())).sum() / ((ts - ts.mean()) ** 2).sum())
                slope = max(slope, 0.0)
                lines[b] = (float(ys.mean()) - slope * float(ts.mean()), slope)
            self._lines = lines
        return self._lines

    def predict(self, b: int, t: int) -> float:
        """Predicted seconds of a forward of B sequences feeding T tokens in all."""
        lines = self._fit()
        if not lines:
            return 1e-3 * (1.0 + 0.05 * t)  # nothing measured yet: a mild slope
        sizes = sorted(lines)
        lo = max((x for x in sizes if x <= b), default=sizes[0])
        hi = min((x for x in sizes if x >= b), default=sizes[-1])

        def at(x: int) -> float:
            a, slope = lines[x]
            return max(a + slope * t, 1e-9)

        if lo == hi:
            return at(lo)
        w = (b - lo) / (hi - lo)
        return (1 - w) * at(lo) + w * at(hi)


@dataclass
class Candidate:
    """One sequence's offer: marginal expected accepted tokens of each extra speculative token."""

    gains: list[float]  # non-increasing, len = its bound this step
    draft_rounds: bool = False  # each token costs one draft-model round (draft method)


def plan(cands: list[Candidate], cost: CostModel, *, batch: int, base_tokens: int,
         draft_round_s: float = 0.0) -> list[int]:
    """Speculative tokens per candidate that maximise expected tokens per second of the step.

    ``batch``: sequences in the forward (B); ``base_tokens``: tokens they feed without
    any speculation; ``draft_round_s``: seconds of one batched draft-model round.
    """
    chosen = [0] * len(cands)
    heap = [(-c.gains[0], i) for i, c in enumerate(cands) if c.gains]
    heapq.heapify(heap)
    tokens = float(batch)
    extra = 0
    rounds = 0
    best_rate = tokens / (cost.predict(batch, base_tokens) + 0.0)
    best = list(chosen)
    while heap:
        neg, i = heapq.heappop(heap)
        chosen[i] += 1
        tokens += -neg
        extra += 1
        if cands[i].draft_rounds:
            rounds = max(rounds, chosen[i])
        rate = tokens / (cost.predict(batch, base_tokens + extra) + rounds * draft_round_s)
        if rate > best_rate * (1 + 1e-6):
            best_rate, best = rate, list(chosen)
        if chosen[i] < len(cands[i].gains):
            heapq.heappush(heap, (-cands[i].gains[chosen[i]], i))
    return best


def linear_gains(alpha: float, bound: int) -> list[float]:
    """Expected acceptance of the 1st..bound-th drafted token when each is accepted w.p. alpha."""
    return [alpha**k for k in range(1, bound + 1)]
