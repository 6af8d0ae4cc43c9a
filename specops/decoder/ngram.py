"""Prompt-lookup (n-gram) drafting: no draft model, just the text seen so far.

To draft γ tokens, find the most recent earlier occurrence of the context's last n
tokens (n from ``max_ngram`` down to ``min_ngram``; the longest match wins) and propose
the γ tokens that followed it. Code, quotes and structured output repeat themselves,
so this costs almost nothing and often accepts well; when nothing matches the step
degrades to one plain target forward.

**Periodic continuation** (where HF's and vLLM's prompt lookup stop short): when the
latest occurrence ends p < γ tokens before the end of the context, the text is repeating
with period p and the tokens after the occurrence run into the context's own suffix; the
proposal continues that period (token k is token k - p of the proposal).

`NgramIndex.propose` can also propose for full-length matches only (``gamma=0`` with
``full_match_gamma``): Medusa's prompt-lookup branch (`medusa_decode`) takes only those,
which are followed far more often than a 1-token match (on the bundled code suite, with 8
tokens drafted, a 3-gram match's continuation was accepted 3.7 tokens deep on average, a
1-gram match's 0.9). Drafting longer after full matches in `generate_ngram` itself did not
pay on the bundled models: past ~5 positions a CPU verify forward is compute-bound and each
extra position costs ~12% of a step.

`NgramIndex` keeps, per n, a dict from n-gram to where its latest occurrence ended,
updated incrementally as tokens are appended, so a lookup is O(max_ngram) instead of a
scan over the whole context.
"""

from __future__ import annotations

import time

import torch

from specops.decoder.errors import InvalidRequestError
from specops.decoder.runner import ModelRunner
from specops.decoder.sampling import SamplingConfig
from specops.decoder.schedule import ConstantSchedule, GammaSchedule
from specops.decoder.request import prompt_list
from specops.decoder.speculation import TargetVerifier
from specops.decoder.stats import DecodeStats


class NgramIndex:
    """An append-only token sequence with an index of the n-grams it contains."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if isinstance(min_ngram, bool) or not isinstance(min_ngram, int) or min_ngram < 1:
            raise InvalidRequestError(f"min_ngram must be an integer >= 1, got {min_ngram!r}")
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < min_ngram:
            raise InvalidRequestError(f"max_ngram must be an integer >= min_ngram ({min_ngram}), got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        # n -> {n-gram: index just after its latest occurrence that has a continuation}
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed_until = 0  # n-grams ending before this index are in _latest

    def extend(self, tokens: list[int]) -> None:
        """Append tokens to the context."""
        self.tokens.extend(int(t) for t in tokens)

    def _catch_up(self) -> None:
        # Index every n-gram that ends at position j with j + 1 < len(tokens), i.e. that
        # has at least one continuation token; the context's own suffix stays out, so
        # a lookup never matches itself.
        toks = self.tokens
        stop = len(toks) - 1
        for j in range(self._indexed_until, stop):
            for n, table in self._latest.items():
                if j + 1 >= n:
                    table[tuple(toks[j + 1 - n : j + 1])] = j + 1
        self._indexed_until = max(self._indexed_until, stop)

    def propose(self, gamma: int, full_match_gamma: int | None = None) -> list[int]:
        """The ``gamma`` tokens that followed the latest match of the longest suffix n-gram,
        continued periodically where they run into the context's end; ``full_match_gamma``
        (None: ``gamma``) tokens instead when the match is ``max_ngram`` long."""
        if not self.tokens:
            return []
        self._catch_up()
        toks = self.tokens
        for n in range(min(self.max_ngram, len(toks)), self.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(toks[-n:]))
            if start is not None:
                want = full_match_gamma if n == self.max_ngram and full_match_gamma is not None else gamma
                out = toks[start : start + want]
                period = len(toks) - start  # the occurrence ends this many tokens before the context does
                while 0 < len(out) < want:
                    out.append(out[len(out) - period])
                return out
        return []


def lookup(context: list[int], gamma: int, max_ngram: int = 3, min_ngram: int = 1,
           full_match_gamma: int | None = None) -> list[int]:
    """One-shot prompt lookup over ``context`` (same result as a fresh `NgramIndex`)."""
    index = NgramIndex(max_ngram=max_ngram, min_ngram=min_ngram)
    index.extend(context)
    return index.propose(gamma, full_match_gamma)


def generate_ngram(
    target: ModelRunner,
    prompt_ids: torch.Tensor,  # [B, T] long, B == 1
    *,
    sampling: SamplingConfig,
    generator: torch.Generator,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    schedule: GammaSchedule | None = None,
    max_ngram: int = 3,
    min_ngram: int = 1,
    deadline_s: float | None = None,
) -> tuple[list[int], DecodeStats]:
    """Speculative decoding with prompt-lookup drafts; returns ``(tokens, DecodeStats)``.

    The drafter is deterministic, so sampling verification treats its proposal as a
    point mass (``q = one_hot``), which keeps the output distribution the target's.
    A step without a match verifies zero drafted tokens, i.e. one plain target step.
    Past ``deadline_s`` seconds the rest is plain decoding.
    """
    if max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    schedule = schedule if schedule is not None else ConstantSchedule(4)
    prompt = prompt_list(prompt_ids)
    stats = DecodeStats(method="ngram")
    stats.start()
    index = NgramIndex(max_ngram=max_ngram, min_ngram=min_ngram)
    index.extend(prompt)
    v = TargetVerifier(
        target,
        prompt,
        sampling=sampling,
        generator=generator,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        stats=stats,
        deadline_s=deadline_s,
    )
    v.prefill()
    while not v.done:
        stats.gamma = schedule.next_gamma()
        gamma = min(stats.gamma, v.max_draft())
        t0 = time.perf_counter()
        drafted = index.propose(gamma)
        draft_s = time.perf_counter() - t0
        stats.draft_s += draft_s
        if v.max_draft() < len(drafted):  # the deadline passed while drafting: this step runs plainly
            drafted = []
        verify_before = stats.verify_s
        result = v.verify(drafted, None)
        index.extend(result.emitted)
        schedule.update(len(drafted), result.raw_accepted, draft_s, stats.verify_s - verify_before)
    stats.finish(v.stop_reason())
    return v.output, stats
