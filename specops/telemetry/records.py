"""The telemetry data model: one finished request (`DecodeRecord`) and a window of them (`WindowStats`).

These are the first of the three metric layers (stats dataclass → aggregator → exporter):
the runtime builds a `DecodeRecord` per finished request (``DecodeStats.to_record``), the
Prometheus exporter and the Redis publisher consume it, and the controller reads
`WindowStats` back (from Redis, Prometheus, vLLM or SGLang adapters).

Terms
-----
drafted
    tokens proposed by a drafter (draft model, n-gram lookup, or Medusa tree path
    candidates counted along the verified path) and sent to the target for checking.
accepted
    drafted tokens the target agreed with (the bonus / recovered token the target
    produces itself is *not* counted as accepted).
acceptance rate
    ``accepted / drafted`` in 0–1.
speed-up
    ``plain_s_estimate / wall_s``: the time plain autoregressive decoding would have
    taken (new tokens × measured single-token target forward seconds) over the time
    the request actually took. Below 1 means speculation made things slower.
"""

from __future__ import annotations

from dataclasses import dataclass, field

METHODS = ("ar", "draft", "medusa", "ngram", "eagle")
GAMMA_METHODS = ("draft", "ngram", "eagle")
"""The methods whose knob is γ, the tokens drafted per step (Medusa's is its heads)."""


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of possibly different lengths."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def _check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{owner}.{name} must be >= 0, got {value!r}")


@dataclass
class DecodeRecord:
    """One finished request (or one chunk of a long one), as the runtime reports it."""

    request_class: str
    """Request class name from the policy (Prometheus label ``class``)."""
    method: str
    """Decoding method used: ``ar`` | ``draft`` | ``medusa`` | ``ngram`` | ``eagle`` (label ``method``)."""
    new_tokens: int
    """Tokens generated (new tokens only, prompt excluded)."""
    drafted: int
    """Draft tokens sent to the target for verification."""
    accepted: int
    """Draft tokens the target accepted (0 <= accepted <= drafted)."""
    accepted_per_pos: list[int]
    """Accepted tokens by draft position: index i counts acceptances at position i (0-based)."""
    target_forwards: int
    """Target model forward passes (prefill included)."""
    draft_s: float
    """Seconds spent drafting."""
    verify_s: float
    """Seconds spent in target verification passes."""
    wall_s: float
    """Seconds the request's decoding took end to end."""
    plain_s_estimate: float
    """new_tokens × measured single-token target forward seconds: the plain-decoding time."""
    token_latencies_s: list[float]
    """Per generated token: seconds between it and the previous token (or the start)."""
    head_predictions: list[int]
    """Medusa: predictions checked per head (index = head); empty for other methods."""
    head_correct: list[int]
    """Medusa: correct predictions per head (index = head); empty for other methods."""
    gamma: int
    """Speculation length γ in force at the end of the request (0 for ar / medusa)."""
    heads: int
    """Medusa heads in use (0 for other methods)."""
    fallback_reason: str | None = None
    """Why the request fell back to plain decoding (e.g. ``deadline``), or None."""
    drafted_per_pos: list[int] = field(default_factory=list)
    """Verification steps that drafted at least i+1 tokens, by position i; element 0 is the
    number of speculative rounds. Empty when unknown (then rounds are taken to have
    drafted the γ in force). Needed wherever γ varies per step (the serving engine
    shortens blocks under load), so acceptance per position is read per drafted position."""
    planned: bool = False
    """The γ / tree size in force was an upper bound under which the runtime planned each
    round from its measured costs (`specops serve`'s engine shortens or skips rounds under
    load by itself). The controller never lowers such a bound for cost (see
    `specops.controller.adapt`)."""

    def __post_init__(self) -> None:
        if not self.request_class:
            raise ValueError("DecodeRecord.request_class must be a non-empty string")
        if self.method not in METHODS:
            raise ValueError(f"DecodeRecord.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _check_non_negative(
            "DecodeRecord",
            new_tokens=self.new_tokens,
            drafted=self.drafted,
            accepted=self.accepted,
            target_forwards=self.target_forwards,
            draft_s=self.draft_s,
            verify_s=self.verify_s,
            wall_s=self.wall_s,
            plain_s_estimate=self.plain_s_estimate,
            gamma=self.gamma,
            heads=self.heads,
        )
        if self.accepted > self.drafted:
            raise ValueError(f"DecodeRecord.accepted ({self.accepted}) exceeds drafted ({self.drafted})")
        if sum(self.accepted_per_pos) != self.accepted:
            raise ValueError(
                f"DecodeRecord.accepted_per_pos sums to {sum(self.accepted_per_pos)}, accepted is {self.accepted}"
            )
        if self.drafted_per_pos:
            if sum(self.drafted_per_pos) != self.drafted:
                raise ValueError(f"DecodeRecord.drafted_per_pos sums to {sum(self.drafted_per_pos)}, "
                                 f"drafted is {self.drafted}")
            for i, a in enumerate(self.accepted_per_pos):
                d = self.drafted_per_pos[i] if i < len(self.drafted_per_pos) else 0
                if a > d:
                    raise ValueError(f"DecodeRecord.accepted_per_pos[{i}]={a} exceeds drafted_per_pos[{i}]={d}")
        if not isinstance(self.planned, bool):
            raise ValueError(f"DecodeRecord.planned must be a bool, got {self.planned!r}")
        if len(self.head_predictions) != len(self.head_correct):
            raise ValueError("DecodeRecord.head_predictions and head_correct must have the same length")
        for i, (p, c) in enumerate(zip(self.head_predictions, self.head_correct)):
            if c > p or c < 0:
                raise ValueError(f"DecodeRecord.head_correct[{i}]={c} must be within 0..head_predictions[{i}]={p}")


@dataclass
class WindowStats:
    """Sums over the requests of one class in a time window (one pod or the fleet).

    ``gamma`` and ``heads`` are request-weighted means of the settings in force.
    Ratios of an empty window are 0.0; callers check volume (``drafted``,
    ``requests``) before acting on them.
    """

    requests: int = 0
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    target_forwards: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    plain_s_estimate: float = 0.0
    head_predictions: list[int] = field(default_factory=list)
    head_correct: list[int] = field(default_factory=list)
    gamma: float = 0.0
    heads: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)
    """Fallback counts by reason (additive to the interface; empty when unknown)."""
    drafted_per_pos: list[int] = field(default_factory=list)
    """Rounds that drafted at least i+1 tokens, by position (see `DecodeRecord`). Complete
    only when it sums to ``drafted``: a source that does not report it (or a window
    mixing such requests) leaves it empty or short."""
    planned: int = 0
    """Requests whose settings were upper bounds planned under per round (`DecodeRecord.planned`)."""

    @classmethod
    def from_record(cls, record: DecodeRecord) -> WindowStats:
        """A window holding exactly one request."""
        return cls(
            requests=1,
            new_tokens=record.new_tokens,
            drafted=record.drafted,
            accepted=record.accepted,
            accepted_per_pos=list(record.accepted_per_pos),
            target_forwards=record.target_forwards,
            draft_s=record.draft_s,
            verify_s=record.verify_s,
            wall_s=record.wall_s,
            plain_s_estimate=record.plain_s_estimate,
            head_predictions=list(record.head_predictions),
            head_correct=list(record.head_correct),
            gamma=float(record.gamma),
            heads=float(record.heads),
            fallbacks={record.fallback_reason: 1} if record.fallback_reason else {},
            drafted_per_pos=list(record.drafted_per_pos),
            planned=int(record.planned),
        )

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted, 0–1 (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def speedup(self) -> float:
        """plain-decoding time estimate / time taken (0.0 when no time was recorded)."""
        return self.plain_s_estimate / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens produced per target forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed of a request stream: new tokens / seconds taken."""
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def head_accuracy(self) -> list[float]:
        """Per Medusa head: correct / predictions (0.0 for a head never checked)."""
        return [c / p if p else 0.0 for p, c in zip(self.head_predictions, self.head_correct)]

    def merge(self, other: WindowStats) -> WindowStats:
        """A new window holding both windows' requests (neither input is changed)."""
        total = self.requests + other.requests
        fallbacks = dict(self.fallbacks)
        for reason, count in other.fallbacks.items():
            fallbacks[reason] = fallbacks.get(reason, 0) + count
        return WindowStats(
            requests=total,
            new_tokens=self.new_tokens + other.new_tokens,
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            accepted_per_pos=_add_lists(self.accepted_per_pos, other.accepted_per_pos),
            target_forwards=self.target_forwards + other.target_forwards,
            draft_s=self.draft_s + other.draft_s,
            verify_s=self.verify_s + other.verify_s,
            wall_s=self.wall_s + other.wall_s,
            plain_s_estimate=self.plain_s_estimate + other.plain_s_estimate,
            head_predictions=_add_lists(self.head_predictions, other.head_predictions),
            head_correct=_add_lists(self.head_correct, other.head_correct),
            gamma=(self.gamma * self.requests + other.gamma * other.requests) / total if total else 0.0,
            heads=(self.heads * self.requests + other.heads * other.requests) / total if total else 0.0,
            fallbacks=fallbacks,
            drafted_per_pos=_add_lists(self.drafted_per_pos, other.drafted_per_pos),
            planned=self.planned + other.planned,
        )
