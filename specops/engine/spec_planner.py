"""Load-aware speculation: per step, how much each sequence speculates.

The cost of a verification forward depends on the whole batch: B sequences feeding T
tokens in all. At batch 1 a forward over 5 tokens costs little more than over 1 (the
weights are read once either way), so drafting 4 tokens is almost free; at batch 16
the same forward is already compute-heavy and every extra drafted token costs real
time that a rejected draft wastes for everyone in the batch. Speculation also costs
outside the target forward: draft-model rounds (a forward of the draft model per
drafted position, batched over the sequences still drafting), Medusa heads and tree
building, n-gram lookups, and the per-sequence verification and KV compaction.

Every cost is measured on the running machine and kept robust to its noise (a shared,
loaded CPU gives spikes several times the typical time): observations go into short
windows and the planner reads their **median**, so one descheduled step neither makes
speculation look free nor ruins it for the next hundred steps.

* `CostModel`: seconds of one forward as a function of (B, T); the engine keeps one
  for the target (verify) and one for the draft model (one drafting round).
* `Meter`: a windowed median of one measured quantity (seconds of per-sequence
  proposal/verification overhead of a method; the step's fixed host time).

`plan` chooses, for every speculating sequence, how many speculative tokens it feeds (γ for
a linear draft, extra nodes for a tree: Medusa's, EAGLE-2's) within its `SpecSettings` bound,
to maximise the expected batch goodput

    (B + sum of the expected accepted tokens of the chosen drafts)
    / (fixed + verify(B, T_plain + drafted) + sum_r draft(B_r, T_r) + sum of overheads)

where ``B_r`` is the number of sequences drafting at least r tokens with the draft
model and ``T_r`` the tokens that round feeds: ``B_r`` after the first; the first feeds
each sequence's `Candidate.first_feed` (what its draft cache lacks: two tokens after a
fully accepted block, more after skipped steps). The overhead of a sequence is charged
once it speculates at all. Each sequence offers marginal gains that never increase (the k-th drafted token of a linear
draft is accepted with probability alpha^k; a tree's k-th best node with its path's
estimated probability), so the plan takes the best gains of all sequences together, in
order, and keeps the prefix with the highest goodput. Speculation is chosen only when
that goodput beats plain decoding by a margin (``margin``, default 3%): gains inside
the noise are not worth their risk. When the batch is large, acceptance low or the
proposals dear, the best prefix is short or empty: speculation shrinks or switches off
by itself (per sequence or for the whole batch), and comes back when it pays again:
a step that declines speculation measures nothing about it, so every `PROBE_EVERY`-th
declined step one sequence (the likeliest to gain) runs its best speculative plan anyway
(`PlanSchedule.probe_every`), keeping the costs and acceptance current.

How this differs from vLLM's static table (``num_speculative_tokens`` with a per
batch-size cutoff, ``speculative_disable_by_batch_size``): that table is written by hand
for one model and one machine and applies one γ to every request. Here the cost is
measured on the running machine (and keeps being measured), the acceptance is each
request's own running estimate, and every sequence gets its own γ or tree size.
"""

from __future__ import annotations

import bisect
import heapq
import math
import statistics
from collections import deque
from dataclasses import dataclass, field


DEFAULT_MARGIN = 0.03  # speculate only for >= 3% more expected tokens/s than plain decoding


class Meter:
    """The median of the last ``window`` observations of one quantity (seconds)."""

    def __init__(self, window: int = 15) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self._median: float | None = None  # cached until the next observation (read every step, per sequence)

    def observe(self, value: float) -> None:
        if value >= 0:
            self.values.append(value)
            self._median = None

    def value(self, default: float = 0.0) -> float:
        if not self.values:
            return default
        if self._median is None:
            self._median = statistics.median(self.values)
        return self._median


class SpecCalibration:
    """How far the plan's predictions of speculative steps miss, per batch size, read from the
    steps' own record, so that a cost no model sees still counts.

    The cost models see the forwards and the per-sequence overheads they are told about; a
    step also pays what nobody modelled (cache effects of a wider batch, a draft cache's
    catch-up, another process on the core). Each decode step is recorded with its real
    seconds (the planner's clock) and its prediction: a speculative step with the plan's
    predicted seconds and a plain step's at that moment, a plain step with its own. At a batch
    size with enough of both, ``scale(B)`` is the real extra cost of speculating over its
    predicted extra, both taken against plain steps' real-over-predicted ratio:

        r_plain = sum(real plain) / sum(predicted plain)
        scale   = (sum(real spec) - r_plain * sum(plain at spec)) / (sum(predicted spec) - sum(plain at spec)) / r_plain

    (clamped to [``lo``, ``hi``]); `plan` multiplies every speculative plan's predicted extra
    seconds by it. Before this, in-process at batch 4, speculative steps predicted at 12.3 ms
    of CPU took 15.1 ms (the tokens they emitted were predicted within 1%): plans predicted
    ~9% faster than plain decoding ran ~7% slower than an `ar` engine's plain steps. Plain probes (`PlanSchedule.plain_probe_every`)
    keep plain samples coming at a batch size that always speculates, and cost probes
    speculative samples at one that never does.
    """

    def __init__(self, window: int = 64, min_spec: int = 12, min_plain: int = 6, lo: float = 0.5,
                 hi: float = 3.0, guard_window: int = 16) -> None:
        self.window, self.min_spec, self.min_plain, self.lo, self.hi = window, min_spec, min_plain, lo, hi
        self.spec: dict[int, deque[tuple[float, float, float]]] = {}  # B -> (real, predicted, plain predicted)
        self.plain: dict[int, deque[tuple[float, float]]] = {}  # B -> (real, predicted)
        self._scale: dict[int, float] = {}
        # realized rates, (tokens, wall seconds): the last guard_window speculative steps since `forget_spec`
        # and the last guard_window plain steps (`losing`): recent, so both read the machine as it is now
        self.guard_window = guard_window
        self.spec_tokens: dict[int, deque[tuple[int, float]]] = {}
        self.plain_tokens: dict[int, deque[tuple[int, float]]] = {}

    def observe_spec(self, b: int, real_s: float, step_s: float, plain_s: float, tokens: int = 0,
                     wall_s: float = 0.0) -> None:
        """One speculative step: its real seconds on the planner's clock, the plan's predicted seconds
        and a plain step's; for `losing`, the tokens it emitted and its wall seconds."""
        if real_s > 0 and step_s > plain_s > 0:
            self.spec.setdefault(b, deque(maxlen=self.window)).append((real_s, step_s, plain_s))
            self._scale.pop(b, None)
        if tokens and wall_s > 0:
            self.spec_tokens.setdefault(b, deque(maxlen=self.guard_window)).append((tokens, wall_s))

    def observe_plain(self, b: int, real_s: float, plain_s: float, tokens: int = 0, wall_s: float = 0.0) -> None:
        if real_s > 0 and plain_s > 0:
            self.plain.setdefault(b, deque(maxlen=self.window)).append((real_s, plain_s))
            self._scale.pop(b, None)
        if tokens and wall_s > 0:
            self.plain_tokens.setdefault(b, deque(maxlen=self.guard_window)).append((tokens, wall_s))

    def losing(self, b: int) -> bool:
        """Whether the last ``guard_window`` speculative steps at batch size ``b`` emitted fewer
        tokens per wall second than its plain steps did (at least `min_plain` of them): whatever
        the models predict, speculating there made decoding slower. Wall time, not the planner's
        CPU clock: a speculative step's many small draft forwards wait longer for a busy core
        (a server's HTTP loop, its clients) than one plain forward, and CPU time does not see it."""
        spec, plain = self.spec_tokens.get(b, ()), self.plain_tokens.get(b, ())
        if len(spec) < self.guard_window or len(plain) < self.min_plain:
            return False
        rate = lambda window: sum(n for n, _ in window) / sum(s for _, s in window)  # noqa: E731
        return rate(spec) < rate(plain)

    def forget_spec(self, b: int) -> None:
        """Judge speculating at ``b`` afresh (`losing` waits for a full window again)."""
        self.spec_tokens.pop(b, None)

    def scale(self, b: int) -> float:
        got = self._scale.get(b)
        if got is None:
            got = self._scale[b] = self._fit(b)
        return got

    def _fit(self, b: int) -> float:
        spec, plain = self.spec.get(b, ()), self.plain.get(b, ())
        if len(spec) < self.min_spec or len(plain) < self.min_plain:
            return 1.0
        r_plain = sum(r for r, _ in plain) / sum(p for _, p in plain)
        extra = sum(s - p for _, s, p in spec)
        real_extra = sum(r for r, _, _ in spec) - r_plain * sum(p for _, _, p in spec)
        return min(max(real_extra / extra / r_plain, self.lo), self.hi)


class CostModel:
    """Seconds of one forward as a function of (batch size B, total new tokens T).

    Observations are kept per exact (B, T) in a window of the last ``window``; a point's
    value is their median (a spike on a shared machine does not move it). A prediction
    interpolates linearly between the measured T of the batch size (made non-decreasing
    in T by isotonic regression: a bigger forward never costs less, whatever the noise)
    and extrapolates past the largest T with the last segment's slope; across batch sizes it interpolates
    linearly between the two nearest batch sizes measured at two T or more (the
    engine's calibration measures a grid of them). Piecewise, not one least-squares
    line: the cost of extra tokens near T = B (what the planner asks) must not be bent
    by far-away points. At B = 1 extra tokens are nearly free, at B = 16 they are not.

    A point not observed again in the last ``max_age`` observations at its batch size is left
    out of the fit (its samples stay, and count again once it is observed again), as long as a
    fresher point remains there. Points above T = B are measured only while the planner
    speculates; one measured in a load spike and never re-measured because of it kept the
    planner pricing extra tokens at several times their cost: at batch 4 in a server, the
    (4, 12) point stood at 8.4 ms of CPU for a whole run while 4-token plain steps took 3-6
    and 9-token verify forwards ran 1.2x those. Left out, the tokens above the fresh points
    are priced by the last fresh segment's slope (flat, with one point): the plan tries them
    and the step's forward measures the point again, right or wrong.

    Past the last point the slope is at least the curve's mean slope (first to last point).
    Isotonic pooling flattens a last segment whose far point read low: in a server on this
    2-core host the startup calibration read (4, 12) at 2.91 ms and (4, 20) at 2.56 ms, the
    pooled curve was flat from T = 12 on, and every token a plan added past it was priced
    free. With the controller's γ 10 cap (the default policy's maximum for code) plans at
    batch 4 reached T = 44, and `fixed` with that cap speculated in 28% of its steps at
    concurrency 4 and ran at 0.87x `off` (with the initial γ 6: 2%).
    """

    def __init__(self, window: int = 9, refit_every: int = 32, warmup: int = 0, max_age: int = 2048) -> None:
        self.window = window
        self.max_age = max_age
        self._count: dict[int, int] = {}  # B -> observations at B so far
        self._last: dict[tuple[int, int], int] = {}  # (B, T) -> `_count[B]` at its last observation
        # observations of each (B, T) dropped before it counts: a shape's first forward pays
        # one-time costs (oneDNN builds its kernels for a new row count, the allocator grows),
        # up to ~100x a warm one; alone in a new point's window it would be its median
        self.warmup = warmup
        self.refit_every = refit_every
        self.samples: dict[tuple[int, int], deque[float]] = {}
        self._curves: dict[int, tuple[list[int], list[float]]] | None = None  # B -> (T ascending, seconds)
        self._sizes: list[int] = []
        self._since_fit = 0
        self._seen: dict[tuple[int, int], int] = {}  # shape -> warm-up observations dropped
        self._ts: dict[int, set[int]] = {}  # B -> the T with samples (the stale check looks at one B only)
        self._medians: dict[tuple[int, int], float] = {}  # (B, T) -> median of its window, kept on observe

    @property
    def points(self) -> dict[tuple[int, int], float]:
        """(B, T) -> median observed seconds."""
        return {k: self._median(k) for k in self.samples}

    def _median(self, key: tuple[int, int]) -> float:
        m = self._medians.get(key)
        if m is None:
            m = self._medians[key] = statistics.median(self.samples[key])
        return m

    def observe(self, b: int, t: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if self._seen.get((b, t), 0) < self.warmup:  # see ``warmup``
            self._seen[(b, t)] = self._seen.get((b, t), 0) + 1
            return
        window = self.samples.get((b, t))
        if window is None:
            window = self.samples[(b, t)] = deque(maxlen=self.window)
            self._ts.setdefault(b, set()).add(t)
            self._curves = None  # a new point: refit now
        window.append(seconds)
        self._medians.pop((b, t), None)
        n = self._count[b] = self._count.get(b, 0) + 1
        if n - self._last.get((b, t), n) > self.max_age:
            self._curves = None  # a point that was left out as stale is back in the fit
        self._last[(b, t)] = n
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._curves = None
        if t > 1:
            self._drop_stale_below(b, t, self._median((b, t)))

    def _drop_stale_below(self, b: int, t: int, now: float) -> None:
        """A forward over fewer tokens never costs more than one over more: a point at T' < T
        whose median is over twice this point's is stale (measured in a load spike and not
        re-measured since, e.g. while the planner declined speculation); it is dropped and
        predictions interpolate around it until it is measured again."""
        ts = self._ts[b]
        stale = [t2 for t2 in ts if 1 < t2 < t and self._median((b, t2)) > 2.0 * now]
        for t2 in stale:
            del self.samples[(b, t2)]
            self._medians.pop((b, t2), None)
            ts.discard(t2)
        if stale:
            self._curves = None

    def _fit(self) -> dict[int, tuple[list[int], list[float]]]:
        if self._curves is None:
            self._since_fit = 0
            by_b: dict[int, list[tuple[int, float]]] = {}
            for (b, t), sec in self.points.items():
                by_b.setdefault(b, []).append((t, sec))
            for b, pts in by_b.items():  # points not re-observed lately (see ``max_age``); one always stays
                now = self._count.get(b, 0)
                fresh = [(t, sec) for t, sec in pts if now - self._last.get((b, t), now) <= self.max_age]
                if fresh and len(fresh) < len(pts):
                    by_b[b] = fresh
            curves = {}
            for b, pts in by_b.items():
                pts.sort()
                curves[b] = ([t for t, _ in pts], isotonic([sec for _, sec in pts]))
            self._curves = curves
            multi = sorted(b for b, (ts, _) in curves.items() if len(ts) >= 2)
            self._sizes = multi or sorted(curves)
        return self._curves

    def measured(self) -> bool:
        return bool(self.samples)

    def predict(self, b: int, t: int) -> float:
        """Predicted seconds of a forward of B sequences feeding T tokens in all."""
        curves = self._fit()
        if not curves:
            return 1e-3 * (1.0 + 0.05 * t)  # nothing measured yet: a mild slope
        sizes = self._sizes
        k = bisect.bisect_left(sizes, b)
        lo = sizes[max(k - 1, 0)] if k == len(sizes) or sizes[k] != b else b
        hi = sizes[min(k, len(sizes) - 1)]
        if hi < b:
            lo = hi

        def at(x: int) -> float:
            ts, ys = curves[x]
            if len(ts) == 1 or t <= ts[0]:
                return ys[0]
            m = bisect.bisect_left(ts, t)
            m = min(max(m, 1), len(ts) - 1)  # the segment [m-1, m] (the last one past the end)
            slope = (ys[m] - ys[m - 1]) / (ts[m] - ts[m - 1])
            if t > ts[-1]:  # past the last point: at least the curve's mean slope (see the class docstring)
                slope = max(slope, (ys[-1] - ys[0]) / (ts[-1] - ts[0]))
                return ys[-1] + slope * (t - ts[-1])
            return max(ys[m - 1] + slope * (t - ts[m - 1]), 1e-9)

        if lo == hi:
            return at(lo)
        w = (b - lo) / (hi - lo)
        return (1 - w) * at(lo) + w * at(hi)


def isotonic(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators, equal weights): a noisy
    point above its right neighbours is averaged with them, not copied onto all of them."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out: list[float] = []
    for total, count in blocks:
        out += [total / count] * int(count)
    return out


@dataclass
class Candidate:
    """One sequence's offer: marginal expected accepted tokens of each extra speculative token."""

    gains: list[float]  # non-increasing, len = its bound this step
    draft_rounds: bool = False  # each token costs one draft-model round (draft method)
    # draft method: tokens its first round feeds the draft model (the committed tokens its draft cache
    # lacks, at least the pending one); that round costs draft(B_0, sum of these), not draft(B_0, B_0)
    first_feed: int = 1
    overhead_s: float = 0.0  # seconds its speculation costs outside the forwards (proposal, verify, compaction)
    proposal: list[int] = field(default_factory=list)  # n-gram: the proposed tokens
    max_nodes: int = 0  # Medusa: the tree's node bound
    # speculates all of its gains whatever the plan's arithmetic says: a request whose speculation is
    # being measured (`SpecSettings.observed`), so the canary analysis and the fallback probes see the
    # setting under test, not the planner's correction of it; the others are planned around it
    forced: bool = False


def plan(cands: list[Candidate], cost: CostModel, *, batch: int, base_tokens: int,
         draft_cost: CostModel | None = None, fixed_s: float = 0.0, margin: float = DEFAULT_MARGIN,
         spec_scale: float = 1.0, out: dict | None = None) -> list[int]:
    """Speculative tokens per candidate that maximise expected tokens per second of the step.

    ``batch``: sequences in the forward (B); ``base_tokens``: tokens they feed without
    any speculation; ``draft_cost``: seconds of one draft-model forward over (B_r
    sequences, B_r tokens); ``fixed_s``: the step's host time outside the forwards,
    paid with or without speculation; ``margin``: the relative goodput gain over
    plain decoding below which nobody speculates (-1: the best speculative plan however
    it compares with plain decoding — the engine's cost probes); ``spec_scale``: what
    speculating really costs beyond a plain step, as a multiple of what the models
    predict (`SpecCalibration`: the steps' own record); ``out``: receives the chosen
    plan's predicted seconds, unscaled (``"step_s"``), and a plain step's (``"plain_s"``).
    """
    chosen = [0] * len(cands)
    heap = [(-c.gains[0], i) for i, c in enumerate(cands) if c.gains]
    heapq.heapify(heap)
    # verify over base + e tokens, predicted as the loop reaches e (it may stop early, below); a draft
    # round of n sequences, predicted once
    verify = [cost.predict(batch, base_tokens)]
    left = sum(sum(c.gains) for c in cands)  # expected tokens not taken yet
    n_draft = sum(1 for c in cands if c.draft_rounds and c.gains) if draft_cost is not None else 0
    round_s = [0.0] + [draft_cost.predict(n, n) for n in range(1, n_draft + 1)]  # rounds after the first
    feed0 = 0  # tokens the first round feeds
    plain_s = fixed_s + verify[0]
    plain_rate = batch / plain_s
    tokens = float(batch)
    extra = 0
    overhead = 0.0
    drafting: list[int] = []  # drafting[r]: sequences drafting more than r tokens with the draft model
    draft_s = 0.0
    best_rate, best = plain_rate * (1 + margin), list(chosen)
    forced = sum(len(c.gains) for c in cands if c.forced)  # tokens taken before any choice (Candidate.forced)
    if forced:
        best_rate = -math.inf
        heap = [(-math.inf if cands[i].forced else neg, i) for neg, i in heap]
        heapq.heapify(heap)
    while heap:
        neg, i = heapq.heappop(heap)
        c = cands[i]
        if c.forced:
            neg = -c.gains[chosen[i]]
        if chosen[i] == 0:
            overhead += c.overhead_s
        chosen[i] += 1
        tokens += -neg
        left += neg
        extra += 1
        verify.append(cost.predict(batch, base_tokens + extra))
        if c.draft_rounds and draft_cost is not None:
            r = chosen[i] - 1
            if r == len(drafting):
                drafting.append(0)
            n = drafting[r]
            if r == 0:
                before = draft_cost.predict(n, feed0) if n else 0.0
                feed0 += max(c.first_feed, 1)
                draft_s += draft_cost.predict(n + 1, feed0) - before
            else:
                draft_s += round_s[n + 1] - round_s[n]
            drafting[r] = n + 1
        rate = tokens / (plain_s + spec_scale * (fixed_s + verify[extra] + draft_s + overhead - plain_s))
        if rate > best_rate and extra >= forced:
            best_rate, best = rate, list(chosen)
        if (extra >= forced and spec_scale >= 0.0
                and (tokens + left) * (1.0 + 1e-9) <= best_rate * (plain_s + spec_scale * (verify[extra] - verify[0] + overhead))):
            # no later plan can beat the best: each adds tokens from `left` at best, and its seconds only grow
            # (the verify curve is non-decreasing in tokens, overheads add, the draft rounds cost >= 0)
            break
        if chosen[i] < len(c.gains):
            heapq.heappush(heap, (-math.inf if c.forced else -c.gains[chosen[i]], i))
    # The prefix follows the gains alone, so a sequence whose draft cache lags (a wide first round)
    # joins as early as its first gain says, and the best prefix may keep it or drop everyone: a
    # fresh sequence's plan without it is not a prefix. One pass drops each lagging one in turn
    # while that raises the rate (declining everything still has to beat the margin).
    if draft_cost is not None and any(b and c.first_feed > 2 for b, c in zip(best, cands)):
        for i, c in enumerate(cands):
            if best[i] and c.draft_rounds and c.first_feed > 2 and not c.forced:
                trial = list(best)
                trial[i] = 0
                rate = (_rate(cands, trial, verify, round_s, draft_cost, batch, fixed_s, spec_scale)
                        if any(trial) else plain_rate * (1 + margin))
                if rate > best_rate:
                    best_rate, best = rate, trial
    if out is not None:
        out["plain_s"] = plain_s
        out["step_s"] = (_rate(cands, best, verify, round_s, draft_cost, batch, fixed_s, 1.0, seconds=True)
                         if any(best) else plain_s)
    return best


def _rate(cands: list[Candidate], chosen: list[int], verify: list[float], round_s: list[float],
          draft_cost: CostModel | None, batch: int, fixed_s: float, spec_scale: float = 1.0,
          seconds: bool = False) -> float:
    """Expected tokens per second of one plan (``chosen`` tokens per candidate), as `plan` counts
    them; with ``seconds``, its predicted seconds instead."""
    tokens, extra, overhead, feed0 = float(batch), 0, 0.0, 0
    depth: list[int] = []
    for c, k in zip(cands, chosen):
        if not k:
            continue
        tokens += sum(c.gains[:k])
        extra += k
        overhead += c.overhead_s
        if c.draft_rounds:
            feed0 += max(c.first_feed, 1)
            depth += [0] * (k - len(depth))
            for r in range(k):
                depth[r] += 1
    draft_s = (draft_cost.predict(depth[0], feed0) + sum(round_s[n] for n in depth[1:])
               if depth and draft_cost is not None else 0.0)
    plain_s = fixed_s + verify[0]
    step_s = plain_s + spec_scale * (fixed_s + verify[extra] + draft_s + overhead - plain_s)
    return step_s if seconds else tokens / step_s


def linear_gains(alpha: float, bound: int) -> list[float]:
    """Expected acceptance of the 1st..bound-th drafted token when each is accepted w.p. alpha."""
    return [alpha**k for k in range(1, bound + 1)]
