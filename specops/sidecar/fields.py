"""Per-request speculation data from the engines' own response fields → `SpecCounts`.

Where each engine reports it (a response body, or any chunk of a stream):

vLLM (``--per-request-spec-decode-metrics summary|detailed``, vLLM PR #48915, as quoted
in mostlygeek/llama-swap issue #1032)
    ``metrics.speculative_decoding``: ``num_draft_tokens``, ``num_accepted_draft_tokens``,
    ``num_spec_steps`` (verify forwards), ``num_spec_tokens`` (γ),
    ``acceptance_histogram`` (index i = steps that accepted exactly i drafts),
    ``mean_acceptance_length``, ``draft_acceptance_rate``.
SGLang (``meta_info`` of the native API; also returned on OpenAI responses by builds
that expose it). Read from sgl-project/sglang: the fields are set per request by
``python/sglang/srt/managers/tokenizer_manager_components/spec_decoding_meta.py``
(``fill_spec_decoding_meta``; before that ``TokenizerManager._calculate_spec_decoding_metrics``
in ``python/sglang/srt/managers/tokenizer_manager.py``). Always, when the request ran
speculative steps: ``spec_verify_ct`` (verify forwards), ``spec_accept_length``
(``completion_tokens / spec_verify_ct``, the bonus token included) and ``spec_accept_rate``
(accepted / proposed drafts). The counts were renamed twice; newest first, all read:
``spec_num_correct_drafts`` / ``spec_num_proposed_drafts`` (with the two below kept as
aliases), ``spec_accepted_drafts`` / ``spec_proposed_drafts``, ``spec_accept_token_num`` /
``spec_draft_token_num``. Proposed = ``spec_verify_ct × (speculative_num_draft_tokens − 1)``,
so γ = proposed / verify forwards. The per-request histogram (index i = verify steps that
accepted exactly i drafts, as vLLM's) is ``spec_correct_drafts_histogram``, earlier
``spec_accept_histogram``. Builds with none of the counts: accepted = completion tokens
− verify forwards, proposed = accepted / ``spec_accept_rate``.
specops (``specops serve``)
    the ``specops`` object: ``method``, ``drafted``, ``accepted``, ``gamma``.
llama.cpp (``llama-server``; ``server_slot_stats::to_json`` in tools/server/server-common.cpp,
attached by tools/server/server-task.cpp to the final response of ``/v1/completions`` and
``/v1/chat/completions`` and to the last event of a stream)
    the ``timings`` object: ``prompt_n`` / ``prompt_ms`` (prompt tokens evaluated, cached
    ones excluded, and their time), ``predicted_n`` / ``predicted_ms`` (generated tokens and
    the time from the end of the prompt to the last one, drafting and verification
    included), ``prompt_per_token_ms`` / ``predicted_per_token_ms`` and the ``*_per_second``
    rates derived from those, and — only when the request drafted at least one token —
    ``draft_n`` / ``draft_n_accepted``. So a valid ``timings`` without ``draft_n`` is a
    request that drafted nothing (0 / 0, conclusive); ``draft_n`` without
    ``draft_n_accepted`` is inconclusive. llama-server reports no verify-step count or
    per-position split per request (its ``/metrics`` has both, summed over requests).

Anything missing, of the wrong type, negative or inconsistent gives None —
*inconclusive*: the request still counts (tokens, time), but adds no drafted /
accepted volume, so it can never trigger an acceptance alert or a fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

ENGINES = ("vllm", "sglang", "specops", "llamacpp")


@dataclass(frozen=True)
class SpecCounts:
    """Speculation counts of one request as its engine reported them."""

    drafted: int
    accepted: int
    accepted_per_pos: list[int] = field(default_factory=list)
    verify_forwards: int | None = None   # None: not reported
    gamma: int = 0
    method: str | None = None             # specops only: the method that ran
    # the engine's own timing of the request (llama.cpp ``timings``); None: not reported
    prompt_tokens: int | None = None
    prompt_s: float | None = None
    predicted_tokens: int | None = None
    predicted_s: float | None = None


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value != value or value < 0 or value != int(value):  # NaN, negative, fractional
        return None
    return int(value)


def _seconds(ms: Any) -> float | None:
    """A duration in milliseconds → seconds, or None when it is not a finite number >= 0."""
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms < float("inf"):
        return None
    return ms / 1000.0


def _valid(counts: SpecCounts) -> SpecCounts | None:
    if counts.accepted > counts.drafted:
        return None
    if counts.accepted_per_pos and sum(counts.accepted_per_pos) != counts.accepted:
        counts = replace(counts, accepted_per_pos=[])
    return counts


def from_vllm(body: dict[str, Any]) -> SpecCounts | None:
    metrics = body.get("metrics")
    sd = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(sd, dict):
        return None
    drafted, accepted = _int(sd.get("num_draft_tokens")), _int(sd.get("num_accepted_draft_tokens"))
    if drafted is None or accepted is None:
        return None
    per_pos = _per_pos(sd.get("acceptance_histogram"))
    return _valid(SpecCounts(drafted, accepted, per_pos, _int(sd.get("num_spec_steps")),
                             _int(sd.get("num_spec_tokens")) or 0))


SGLANG_ACCEPTED = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
SGLANG_PROPOSED = ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
SGLANG_HISTOGRAM = ("spec_correct_drafts_histogram", "spec_accept_histogram")


def _first(meta: dict[str, Any], names: tuple[str, ...]) -> Any:
    return next((meta[n] for n in names if n in meta), None)


def _per_pos(hist: Any) -> list[int]:
    """Accepted drafts by position from a histogram of drafts accepted per verify step."""
    if not (isinstance(hist, list) and hist and all(_int(h) is not None for h in hist)):
        return []
    counts = [int(h) for h in hist]
    # position p accepted in every step that accepted more than p drafts
    return [sum(counts[p + 1:]) for p in range(len(counts) - 1)]


def from_sglang(body: dict[str, Any]) -> SpecCounts | None:
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        return None
    verify = _int(meta.get("spec_verify_ct"))
    if verify is None or verify == 0:
        return None
    accepted = _int(_first(meta, SGLANG_ACCEPTED))
    if accepted is None:
        tokens = _int(meta.get("completion_tokens"))
        if tokens is None:
            return None
        accepted = max(0, tokens - verify)  # each verify forward emits its accepted drafts + one token
    drafted = _int(_first(meta, SGLANG_PROPOSED))
    if drafted is None:
        rate = meta.get("spec_accept_rate")
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate <= 1:
            return None
        drafted = round(accepted / rate)
    gamma = drafted // verify if drafted % verify == 0 else 0
    return _valid(SpecCounts(drafted, accepted, _per_pos(_first(meta, SGLANG_HISTOGRAM)), verify, gamma))


def from_specops(body: dict[str, Any]) -> SpecCounts | None:
    info = body.get("specops")
    if not isinstance(info, dict):
        return None
    drafted, accepted = _int(info.get("drafted")), _int(info.get("accepted"))
    if drafted is None or accepted is None:
        return None
    method = info.get("method") if isinstance(info.get("method"), str) else None
    return _valid(SpecCounts(drafted, accepted, [], None, _int(info.get("gamma")) or 0, method))


def from_llamacpp(body: dict[str, Any]) -> SpecCounts | None:
    timings = body.get("timings")
    if not isinstance(timings, dict):
        return None
    predicted = _int(timings.get("predicted_n"))
    if predicted is None:
        return None
    if "draft_n" in timings:
        drafted, accepted = _int(timings.get("draft_n")), _int(timings.get("draft_n_accepted"))
        if drafted is None or accepted is None:
            return None
    else:  # llama-server leaves both out when the request drafted nothing
        drafted = accepted = 0
    if accepted > predicted:
        return None
    return _valid(SpecCounts(drafted, accepted, prompt_tokens=_int(timings.get("prompt_n")),
                             prompt_s=_seconds(timings.get("prompt_ms")), predicted_tokens=predicted,
                             predicted_s=_seconds(timings.get("predicted_ms"))))


_PARSERS = {"vllm": from_vllm, "sglang": from_sglang, "specops": from_specops, "llamacpp": from_llamacpp}


def extract(engine: str, body: Any) -> SpecCounts | None:
    """The counts in one response body / stream chunk, or None (inconclusive)."""
    if not isinstance(body, dict):
        return None
    return _PARSERS[engine](body)


def completion_tokens(body: Any) -> int | None:
    """``usage.completion_tokens`` of a body / usage chunk, if present."""
    usage = body.get("usage") if isinstance(body, dict) else None
    return _int(usage.get("completion_tokens")) if isinstance(usage, dict) else None
