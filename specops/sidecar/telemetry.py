"""Per-class `DecodeRecord`s from proxied requests, and the speed-up estimator.

What one request yields (`Observation`): the pool that served it, the time to the
first content chunk (TTFT), the last content chunk, the content chunks' gaps, the
completion tokens (``usage`` when the engine sends it, else one per content chunk)
and the engine's `SpecCounts` (None: inconclusive).

Speed-up estimator
------------------
An engine cannot run the same request both ways, so the plain-decoding time of a
request served by the speculative pool is estimated from the *plain pool's* measured
decode speed: ``plain_tps`` is an exponentially weighted mean (weight ``alpha``) of
``(tokens − 1) / (last_chunk − first_chunk)`` over requests the plain pool streamed
(non-streamed ones: ``tokens / wall``; when the engine times the request itself —
llama.cpp's ``timings.predicted_n`` / ``predicted_ms`` — its decode speed
``(predicted_n − 1) / predicted_ms`` instead, streamed or not), and for a speculative request

    plain_s_estimate = ttft + (tokens − 1) / plain_tps        wall_s = its measured time

(not streamed, with the engine's own decode time ``d``: ``wall_s − d + (tokens − 1) /
plain_tps``), so ``speedup = Σ plain_s_estimate / Σ wall_s`` compares the two pools' decode speed
at the same prefill cost. Fallen-back classes feed the plain pool's baseline; their
probes (and every speculating class) are measured against it. Until the plain pool
has served ``min_baseline`` requests — or with a single pool, where there is no plain
baseline — ``plain_s_estimate = wall_s``: a neutral 1.0 that can never push a
``speedup < 1`` alert over its threshold. Requests on the plain pool record
``plain_s_estimate = wall_s`` (they *are* plain decoding).

``verify_s`` is the engine's own generation time where it reports one (llama.cpp's
``predicted_ms``: drafting and verification together; ``draft_s`` stays 0), else 0.
Completion tokens: ``usage`` first, then the engine's own count (llama.cpp's
``predicted_n``), then one per content chunk.

Engine counts missing or malformed → ``drafted = accepted = 0`` (inconclusive: the
alert rules' ``min_samples`` on drafted tokens ignore them), never a crash.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from specops.sidecar.fields import SpecCounts
from specops.sidecar.routing import Route
from specops.telemetry.records import GAMMA_METHODS, METHODS, DecodeRecord


@dataclass
class Observation:
    """What the proxy saw of one request."""

    pool: str
    spec_pool: bool                   # served by the speculative pool
    wall_s: float
    ttft_s: float | None = None       # first content chunk (streams)
    decode_s: float | None = None     # first → last content chunk (streams)
    gaps_s: list[float] = field(default_factory=list)
    chunks: int = 0                   # content chunks
    usage_tokens: int | None = None
    counts: SpecCounts | None = None

    @property
    def tokens(self) -> int:
        if self.usage_tokens is not None:
            return self.usage_tokens
        if self.counts is not None and self.counts.predicted_tokens is not None:
            return self.counts.predicted_tokens
        return self.chunks


class PoolSpeed:
    """EWMA of a pool's decode tokens/s (see module docstring)."""

    def __init__(self, alpha: float = 0.2, min_baseline: int = 3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.min_baseline = min_baseline
        self._tps: dict[str, float] = {}
        self._n: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe(self, pool: str, obs: Observation) -> None:
        n = obs.tokens
        engine = obs.counts
        if engine is not None and engine.predicted_s and engine.predicted_tokens and engine.predicted_tokens >= 2:
            # the engine's own decode time (llama.cpp: the first token comes with the prompt pass)
            tps = (engine.predicted_tokens - 1) / engine.predicted_s
        elif obs.decode_s is not None and obs.decode_s > 0 and n >= 2:
            tps = (n - 1) / obs.decode_s
        elif obs.decode_s is None and obs.wall_s > 0 and n >= 1:
            tps = n / obs.wall_s
        else:
            return
        with self._lock:
            old = self._tps.get(pool)
            self._tps[pool] = tps if old is None else old + self.alpha * (tps - old)
            self._n[pool] = self._n.get(pool, 0) + 1

    def tps(self, pool: str) -> float | None:
        with self._lock:
            return self._tps.get(pool) if self._n.get(pool, 0) >= self.min_baseline else None


def to_record(route: Route, obs: Observation, plain_tps: float | None) -> DecodeRecord:
    """The contract's record for one proxied request."""
    counts = obs.counts
    n = obs.tokens
    method = route.method if obs.spec_pool else "ar"
    if counts is not None and counts.method in METHODS:
        method = counts.method
    if method not in METHODS:
        method = "ar"
    drafted = accepted = 0
    per_pos: list[int] = []
    forwards = n
    if counts is not None and method != "ar":
        drafted, accepted, per_pos = counts.drafted, counts.accepted, list(counts.accepted_per_pos)
        if not per_pos and accepted:
            # the engine gave no per-position split; the contract needs one that sums to accepted,
            # so it all lands on position 0 (per-position panels are meaningful for vLLM only)
            per_pos = [accepted]
        forwards = counts.verify_forwards if counts.verify_forwards is not None else max(1, n - accepted)
    if method != "ar" and plain_tps and obs.ttft_s is not None and n >= 1:
        plain_s = obs.ttft_s + (n - 1) / plain_tps
    elif method != "ar" and plain_tps and counts is not None and counts.predicted_s is not None and n >= 1:
        # not streamed, timed by the engine: the measured time with its decode part at the plain speed
        plain_s = max(0.0, obs.wall_s - counts.predicted_s) + (n - 1) / plain_tps
    elif method != "ar" and plain_tps and obs.decode_s is None and n >= 1:
        plain_s = n / plain_tps
    else:
        plain_s = obs.wall_s
    latencies = ([obs.ttft_s] if obs.ttft_s is not None else []) + list(obs.gaps_s)
    return DecodeRecord(
        request_class=route.request_class, method=method, new_tokens=n, drafted=drafted, accepted=accepted,
        accepted_per_pos=per_pos, target_forwards=forwards, draft_s=0.0, verify_s=_verify_s(counts),
        wall_s=max(0.0, obs.wall_s),
        plain_s_estimate=max(0.0, plain_s), token_latencies_s=latencies, head_predictions=[], head_correct=[],
        gamma=(counts.gamma or route.gamma) if (counts is not None and method in GAMMA_METHODS) else
        (route.gamma if method in GAMMA_METHODS else 0),
        heads=0, fallback_reason=route.fallback_reason)


def _verify_s(counts: SpecCounts | None) -> float:
    """The engine's generation time when it reports one (llama.cpp: drafting included), else 0."""
    return counts.predicted_s if counts is not None and counts.predicted_s is not None else 0.0
