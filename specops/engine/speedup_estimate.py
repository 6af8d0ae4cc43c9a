"""The batching engine's plain-decoding time estimate (the telemetry's speed-up, per request).

A request's ``plain_s_estimate`` is its wall time with each of its decode steps replaced by
what plain decoding would have spent there (`specops.spec.stats.DecodeStats.to_record`:
``wall_s − decode_step_s + plain_decode_s``). `PlainTimeEstimate.count` adds one engine step
to every sequence that emitted tokens in it:

* a step where every sequence decoded plainly and none prefilled **measures** a plain step
  at its batch size (the mean of the last ``window`` such steps is the reference);
* a decode step: *tokens emitted × the plain step at this batch size*;
* a step that also **prefilled** another request would have been slow under plain decoding
  too: its first token counts the step as it was, the rest plain steps — but only the part of
  the step plain decoding would also have run. When the step also speculated, its drafting
  (the plan's wall seconds: proposals, draft-model rounds) and the target forward's share of
  the draft tokens it verified (``spec_s``) are speculation's cost, not the prefill's: counted
  as the prefill's, a speculating step that shared a prompt's prefill read its drafting as
  free (with every request speculating at 16 concurrent streams on the bundled models, 28–33%
  of the tokens came from such steps: `specops bench speedup-truth`, docs/telemetry.md).

Before any plain step was measured a step counts as plain (a neutral 1.0). A batch size never
seen plain takes the nearest measured one, scaled by the cost model's forward ratio.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from typing import Any


class PlainTimeEstimate:
    """Per batch size, the wall seconds of the last ``window`` all-plain, prefill-free steps."""

    def __init__(self, window: int = 64) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.window = window
        self.windows: dict[int, deque[float]] = {}

    def plain_step_s(self, b: int, cost: Any = None) -> float | None:
        """Wall seconds of a plain step of ``b`` sequences: measured at ``b``, else the nearest
        measured batch size scaled by ``cost.predict`` (a `CostModel`, when it has measured
        anything); None before any plain step."""
        if self.windows.get(b):
            return statistics.fmean(self.windows[b])
        measured = [x for x, w in self.windows.items() if w]
        if not measured:
            return None
        near = min(measured, key=lambda x: (abs(x - b), x))
        base = statistics.fmean(self.windows[near])
        if cost is not None and cost.measured():
            there = cost.predict(near, near)
            if there > 0:
                return base * cost.predict(b, b) / there
        return base

    def count(self, b: int, step_s: float, emitted: Iterable[tuple[Any, int]], *, speculated: bool,
              prefilled: bool, spec_s: float = 0.0, cost: Any = None) -> None:
        """Add one step of ``b`` sequences that took ``step_s`` to each ``(sequence, tokens emitted)``'s
        ``stats`` (``decode_step_s`` and ``plain_decode_s``); ``spec_s``: the step's seconds of
        speculation work (see the module docstring), at most ``step_s``."""
        if spec_s < 0:
            raise ValueError(f"spec_s must be >= 0, got {spec_s!r}")
        if not speculated and not prefilled:
            self.windows.setdefault(b, deque(maxlen=self.window)).append(step_s)
        plain = self.plain_step_s(b, cost)
        shared = max(step_s - (spec_s if speculated else 0.0), 0.0)  # what plain decoding would also have run
        for seq, n in emitted:
            stats = seq.stats
            stats.decode_step_s += step_s
            if plain is None:  # nothing measured yet: this step counts as plain (a neutral 1.0)
                counterfactual = step_s
            elif prefilled:
                counterfactual = shared + max(n - 1, 0) * plain
            else:
                counterfactual = n * plain
            stats.plain_decode_s = (stats.plain_decode_s or 0.0) + counterfactual
