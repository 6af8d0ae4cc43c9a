"""Per-request decoding statistics: what happened, step by step, in one ``generate``.

`DecodeStats` is the first of the three metric layers (stats → aggregator →
exporter): the loops fill it while decoding, `DecodeStats.to_record` turns it into the
torch-free `specops.telemetry.DecodeRecord` that the Prometheus exporter and the Redis
publisher consume. Terms (drafted, accepted, recovered, bonus) are defined in
`specops.spec.verify`.

Invariants the loops keep (and the tests check):

* ``accepted == sum(accepted_per_pos)`` and ``drafted == sum(drafted_per_pos)``;
* ``accepted_per_pos[i] <= drafted_per_pos[i]``, both non-increasing in i;
* ``len(gamma_trace) == steps``, one entry per verification step (its drafted length);
* ``new_tokens == len(tokens) == sum(step tokens) == len(token_latencies_s)``.

Counts only cover tokens that were emitted: when EOS or ``max_new_tokens`` cuts a
block, the drafted tokens after the cut count neither as drafted nor as accepted.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

STOP_REASONS = ("eos", "max_new_tokens", "context")


@dataclass
class DecodeStats:
    """Counters and timings of one request (see the module docstring for the invariants)."""

    method: str
    """Method that actually ran: ``ar`` | ``draft`` | ``ngram`` | ``medusa`` | ``auto``."""
    new_tokens: int = 0
    """Tokens generated (prompt excluded)."""
    drafted: int = 0
    """Drafted tokens sent to the target for verification."""
    accepted: int = 0
    """Drafted tokens the target accepted."""
    accepted_per_pos: list[int] = field(default_factory=list)
    """Index i: steps in which draft position i (0-based) was accepted."""
    drafted_per_pos: list[int] = field(default_factory=list)
    """Index i: steps in which a token was drafted at position i (acceptance by position
    is ``accepted_per_pos[i] / drafted_per_pos[i]``)."""
    target_forwards: int = 0
    """Target forward passes, prefill included."""
    draft_forwards: int = 0
    """Draft model forward passes, prefill included (0 for ar / ngram / medusa)."""
    steps: int = 0
    """Verification steps (speculative methods) or decode steps (ar) after the prefill."""
    draft_s: float = 0.0
    """Seconds spent drafting (draft model forwards, sampling, n-gram lookup)."""
    verify_s: float = 0.0
    """Seconds spent in target forwards and acceptance (prefill included)."""
    prefill_s: float = 0.0
    """Seconds of the target (and draft) prompt prefill, also inside verify_s / draft_s."""
    wall_s: float = 0.0
    """Seconds from the start of decoding to the last token."""
    tokens_per_s: float = 0.0
    """new_tokens / wall_s."""
    gamma_trace: list[int] = field(default_factory=list)
    """Tokens drafted at each step, in order (γ after clamping to budget and context;
    an EOS cut does not shorten it)."""
    gamma: int = 0
    """γ the schedule chose for the last step, before budget/context clamps (0 for ar)."""
    token_latencies_s: list[float] = field(default_factory=list)
    """Per emitted token: its step's seconds divided by the tokens that step emitted (the
    first step includes the prefill)."""
    head_predictions: list[int] = field(default_factory=list)
    """Medusa: predictions checked per head (index = head)."""
    head_correct: list[int] = field(default_factory=list)
    """Medusa: correct predictions per head."""
    heads: int = 0
    """Medusa heads in use (0 for other methods)."""
    fallback_reason: str | None = None
    """Why this request ran plain decoding instead of the requested method, or None."""
    stop_reason: str | None = None
    """``eos`` | ``max_new_tokens`` | ``context`` (the model's context window filled up)."""
    plain_token_s: float | None = None
    """Measured seconds of one single-token target forward, used for the speed-up estimate."""
    auto_steps: dict[str, int] = field(default_factory=dict)
    """``auto``: steps run per option (plain, ngram, draft, medusa, eagle); empty for other methods."""
    store_drafts: int = 0
    """``ngram``: steps whose draft came from the corpus n-gram store (`specops.spec.ngram_store`)."""
    decode_step_s: float = 0.0
    """Batched serving: wall seconds of the engine steps this request decoded in (its
    prefill steps excluded), whatever else the batch held."""
    plain_decode_s: float | None = None
    """Batched serving: what those steps would have taken with plain decoding at the same
    batch sizes (tokens emitted x the engine's measured plain step time at that batch
    size); None outside the engine. Set, it replaces ``plain_token_s`` in `to_record`."""
    planned: bool = False
    """Batched serving: γ / tree size were upper bounds the engine planned each round under
    (`DecodeRecord.planned`)."""
    _start: float = field(default=0.0, init=False, repr=False, compare=False)
    _last_emit: float = field(default=0.0, init=False, repr=False, compare=False)

    def start(self) -> None:
        """Mark the start of decoding (before the prefill)."""
        self._start = self._last_emit = time.perf_counter()

    def record_step(self, drafted: int, accepted: int, gamma: int | None = None) -> None:
        """Count one verification step of ``drafted`` tokens of which ``accepted`` were kept.

        ``gamma`` is the block length actually drafted when an EOS cut made ``drafted``
        smaller (default: ``drafted``).
        """
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted ({accepted}) must be within 0..drafted ({drafted})")
        self.steps += 1
        self.gamma_trace.append(drafted if gamma is None else gamma)
        self.drafted += drafted
        self.accepted += accepted
        for counts, n in ((self.drafted_per_pos, drafted), (self.accepted_per_pos, accepted)):
            if len(counts) < n:
                counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    def record_emitted(self, count: int) -> None:
        """``count`` tokens were emitted now: split the time since the last emission among them."""
        if count <= 0:
            return
        now = time.perf_counter()
        share = (now - self._last_emit) / count
        self.token_latencies_s.extend([share] * count)
        self._last_emit = now
        self.new_tokens += count

    def finish(self, stop_reason: str) -> None:
        """Close the request: wall time, tokens/s and why it stopped."""
        if stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason must be one of {STOP_REASONS}, got {stop_reason!r}")
        self.stop_reason = stop_reason
        self.wall_s = time.perf_counter() - self._start
        self.tokens_per_s = self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0
        self.accepted_per_pos = list(self.accepted_per_pos)
        while len(self.accepted_per_pos) < len(self.drafted_per_pos):
            self.accepted_per_pos.append(0)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per target forward pass (prefill included)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def to_record(self, request_class: str, pod: str | None = None, plain_token_s: float | None = None):
        """This request as a `specops.telemetry.DecodeRecord` for the exporters.

        ``pod`` is accepted for the publisher's convenience and not part of the record
        (the Redis publisher is constructed per pod). ``plain_token_s`` overrides the
        measured single-token forward time; without either, the mean target forward time
        of this request stands in (an upper bound, so the speed-up is then optimistic).

        A request decoded by the batching engine carries ``plain_decode_s``: there the
        plain estimate is the request's wall time with its decode steps replaced by plain
        steps at the same batch sizes (``wall_s - decode_step_s + plain_decode_s``), since
        one forward's time is shared by the whole batch and a per-forward figure would
        put batched requests' speed-up near 1 / batch size.
        """
        from specops.telemetry import DecodeRecord  # torch-free; imported lazily

        per_token = plain_token_s if plain_token_s is not None else self.plain_token_s
        if per_token is None:
            per_token = self.verify_s / self.target_forwards if self.target_forwards else 0.0
        plain_s = self.new_tokens * per_token
        if plain_token_s is None and self.plain_decode_s is not None:
            plain_s = max(self.wall_s - self.decode_step_s + self.plain_decode_s, 0.0)
        return DecodeRecord(
            request_class=request_class,
            method=self.method,
            new_tokens=self.new_tokens,
            drafted=self.drafted,
            accepted=self.accepted,
            accepted_per_pos=list(self.accepted_per_pos),
            target_forwards=self.target_forwards,
            draft_s=self.draft_s,
            verify_s=self.verify_s,
            wall_s=self.wall_s,
            plain_s_estimate=plain_s,
            token_latencies_s=list(self.token_latencies_s),
            head_predictions=list(self.head_predictions),
            head_correct=list(self.head_correct),
            gamma=self.gamma,
            heads=self.heads,
            fallback_reason=self.fallback_reason,
            drafted_per_pos=list(self.drafted_per_pos),
            planned=self.planned,
        )

    def summary(self) -> dict[str, float]:
        """A few derived figures for logs and tables."""
        lat = self.token_latencies_s
        return {
            "new_tokens": float(self.new_tokens),
            "tokens_per_s": self.tokens_per_s,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_len": self.mean_accepted_len,
            "p50_token_latency_s": statistics.median(lat) if lat else 0.0,
        }
