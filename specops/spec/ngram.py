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

**Corpus fallback** (``store``, an `specops.spec.ngram_store.NgramStore`): where the
context has no match, or only a 1-token one, the index drafts the store's chain instead
when it is longer (what usually follows the text's last 2-3 tokens in a corpus); the
models' own folder may carry one (`Decoder.from_pretrained` loads it).

`NgramIndex` keeps, per n, a dict from n-gram to where its latest occurrence ended,
updated incrementally as tokens are appended, so a lookup is O(max_ngram) instead of a
scan over the whole context.
"""

from __future__ import annotations

import torch

from specops.spec.errors import InvalidRequestError
from specops.spec.ngram_store import NgramStore
from specops.models.runner import ModelRunner
from specops.spec.sampling import SamplingConfig
from specops.spec.schedule import ConstantSchedule, GammaSchedule
from specops.spec.request import prompt_list
from specops.spec.speculation import StepResult, TargetVerifier
from specops.spec.stats import DecodeStats
from specops.spec.step import run_steps


class NgramIndex:
    """An append-only token sequence with an index of the n-grams it contains."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, store: NgramStore | None = None) -> None:
        if isinstance(min_ngram, bool) or not isinstance(min_ngram, int) or min_ngram < 1:
            raise InvalidRequestError(f"min_ngram must be an integer >= 1, got {min_ngram!r}")
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < min_ngram:
            raise InvalidRequestError(f"max_ngram must be an integer >= min_ngram ({min_ngram}), got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.store = store
        self.store_drafts = 0  # proposals that came from the store
        self.last_match = -1
        """How long the match behind the latest `propose` was (`match`'s count; 0: the store's chain,
        -1: nothing matched)."""
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

    def match(self, count_back: bool = True) -> tuple[int, int] | None:
        """(where the latest occurrence of the longest suffix n-gram ends, how many tokens the
        context's suffix and that occurrence's run agree on, counted back up to MATCH_SPAN), or
        None without a match. The agreement can run past ``max_ngram``: the index finds a match
        by its last ``max_ngram`` tokens, and this reads how far back it really goes
        (``count_back=False``: it does not, and a full-length match reads ``max_ngram``)."""
        if not self.tokens:
            return None
        self._catch_up()
        toks = self.tokens
        for n in range(min(self.max_ngram, len(toks)), self.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(toks[-n:]))
            if start is not None:
                length = n
                if n == self.max_ngram and count_back:
                    while length < MATCH_SPAN and start > length and toks[start - 1 - length] == toks[-1 - length]:
                        length += 1
                return start, length
        return None

    def propose(self, gamma: int, full_match_gamma: int | None = None, *, by_match: bool = False) -> list[int]:
        """The ``gamma`` tokens that followed the latest match of the longest suffix n-gram,
        continued periodically where they run into the context's end; ``full_match_gamma``
        (None: ``gamma``) tokens instead when the match is ``max_ngram`` long. ``by_match``:
        as many as `match_gamma` gives for the match's length (``gamma`` the usual length)."""
        found = self.match(count_back=by_match)  # only `match_gamma` reads past max_ngram
        if self.store is not None and gamma > 0 and (found is None or found[1] <= 1):
            chain = self.store.chain(self.tokens, gamma)
            if len(chain) > (0 if found is None else 1):  # a 1-token match's continuation is followed ~1 deep
                self.store_drafts += 1
                self.last_match = 0
                return chain
        if found is None:
            self.last_match = -1
            return []
        start, length = found
        self.last_match = length
        if by_match:
            want = match_gamma(gamma, length)
        elif length >= self.max_ngram and full_match_gamma is not None:
            want = full_match_gamma
        else:
            want = gamma
        return self.continuation(start, want)

    def step_drafts(self, gamma: int, room: int, *, by_match: bool = True) -> list[int]:
        """What one speculative step drafts with this index: `propose` for the schedule's
        ``gamma`` within ``room`` speculative slots (the context's or the budget's), by the
        match's length unless ``by_match`` is False. The library's loops and the serving
        engine draft through this, so an n-gram step proposes the same tokens in both."""
        if room <= 0 or gamma <= 0:
            return []
        return self.propose(min(gamma, room), by_match=by_match)[:room]

    def continuation(self, start: int, count: int) -> list[int]:
        """The ``count`` tokens from index ``start`` on (a `match`'s end), continued periodically
        where they run into the context's end."""
        toks = self.tokens
        out = toks[start : start + count]
        period = len(toks) - start  # the occurrence ends this many tokens before the context does
        while 0 < len(out) < count:
            out.append(out[len(out) - period])
        return out


MATCH_SPAN = 16
"""`NgramIndex.match` counts a match's length up to this many tokens."""


def match_gamma(gamma: int, length: int) -> int:
    """How many tokens to draft after a match ``length`` tokens long, for a usual length ``gamma``.

    How deep a match's continuation is accepted grows with how far back the match goes. On
    the bundled code suite (greedy, 128 tokens, every step's proposal of 8 checked against the
    target's own continuation) the mean accepted depth was 1.0 after a 1-token match, 2.05
    after 2, 2.65 after 3-4, 3.5 after 5-7, 4.9 after 8-15 and 7.2 after 16 or more (81% of
    those accepted all 8). One γ for all of them drafts too deep after short matches (each
    drafted position costs 6-14% of a step on CPU) and too shallow after long ones. So: 1 token
    after a 1-token match, 2 after 2, ``gamma`` after 3-7, 1.5 ``gamma`` after 8-15 and 2
    ``gamma`` after 16 or more. Replayed on those steps with the measured verify-cost curve,
    tokens per unit of verify cost went 1.52 -> 1.63 against a constant γ = 4."""
    if length <= 0 or gamma <= 0:
        return 0
    if length < 3:
        return min(gamma, length)
    if length < 8:
        return gamma
    if length < MATCH_SPAN:
        return (3 * gamma + 1) // 2
    return 2 * gamma


def lookup(context: list[int], gamma: int, max_ngram: int = 3, min_ngram: int = 1,
           full_match_gamma: int | None = None) -> list[int]:
    """One-shot prompt lookup over ``context`` (same result as a fresh `NgramIndex`)."""
    index = NgramIndex(max_ngram=max_ngram, min_ngram=min_ngram)
    index.extend(context)
    return index.propose(gamma, full_match_gamma)


class NgramProposer:
    """Prompt lookup as a `step.Proposer`: ``index`` (filled with the prompt at `start`) drafts
    by its match's length (`NgramIndex.step_drafts`) and reads every emitted token. It needs no
    model and has no context of its own (its `room` is unbounded)."""

    method = "ngram"
    device = torch.device("cpu")

    def __init__(self, index: NgramIndex, *, by_match: bool = True) -> None:
        self.index = index
        self.by_match = by_match
        self._peeked: tuple[tuple[int, int, int], list[int]] | None = None

    def peek(self, gamma: int, limit: int) -> list[int]:
        """What `propose` drafts for this step (kept for it, so the index is asked once a step:
        `auto` looks before it chooses)."""
        drafts = self.index.step_drafts(gamma, limit, by_match=self.by_match)
        self._peeked = ((gamma, limit, len(self.index.tokens)), drafts)
        return drafts

    def start(self, v: TargetVerifier) -> None:
        self.index.extend(v.tokens)

    def room(self, v: TargetVerifier) -> None:
        return None

    def propose(self, v: TargetVerifier, gamma: int, limit: int) -> tuple[list[int], None]:
        peeked, self._peeked = self._peeked, None
        if peeked is not None and peeked[0] == (gamma, limit, len(self.index.tokens)):
            return peeked[1], None
        # the limit bounds a long match's draft past γ
        return self.index.step_drafts(gamma, limit, by_match=self.by_match), None

    def sync(self, v: TargetVerifier, result: StepResult) -> float:
        self.index.extend(result.emitted)
        return 0.0


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
    by_match: bool = True,
    store: NgramStore | None = None,
) -> tuple[list[int], DecodeStats]:
    """Speculative decoding with prompt-lookup drafts; returns ``(tokens, DecodeStats)``.

    ``by_match`` (the default): each step drafts `match_gamma` tokens for its match's length,
    the schedule's γ being the usual length (False: γ after every match).

    The drafter is deterministic, so sampling verification treats its proposal as a
    point mass (``q = one_hot``), which keeps the output distribution the target's.
    A step without a match verifies zero drafted tokens, i.e. one plain target step.
    Past ``deadline_s`` seconds the rest is plain decoding. ``store``: the corpus fallback
    (`NgramIndex`); ``stats.store_drafts`` counts the steps it drafted.
    """
    if max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not isinstance(by_match, bool):
        raise InvalidRequestError(f"by_match must be true or false, got {by_match!r}")
    stats = DecodeStats(method="ngram")
    stats.start()
    prompt = prompt_list(prompt_ids)
    index = NgramIndex(max_ngram=max_ngram, min_ngram=min_ngram, store=store)
    v = TargetVerifier(target, prompt, sampling=sampling, generator=generator, max_new_tokens=max_new_tokens,
                       eos_token_id=eos_token_id, stats=stats, deadline_s=deadline_s)
    run_steps(v, NgramProposer(index, by_match=by_match), schedule if schedule is not None else ConstantSchedule(4))
    stats.store_drafts = index.store_drafts
    stats.finish(v.stop_reason())
    return v.output, stats
