"""Prompt-lookup drafting: longest and most recent match, never the suffix itself."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specops.spec.errors import InvalidRequestError
from specops.decoder import Decoder
from specops.spec.ngram import MATCH_SPAN, NgramIndex, lookup, match_gamma
from tests.decoder.tiny_models import VOCAB, tiny_llama


def brute_force(context: list[int], gamma: int, max_ngram: int, min_ngram: int,
                full_match_gamma: int | None = None) -> list[int]:
    """Reference: scan for the latest earlier occurrence of the longest suffix n-gram and read
    what follows it in the context extended by the proposal itself (a repetition goes on)."""
    for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # occurrence must end before the last token
            if context[start : start + n] == suffix:
                want = full_match_gamma if n == max_ngram and full_match_gamma is not None else gamma
                extended = list(context)
                for k in range(want):
                    extended.append(extended[start + n + k])
                return extended[len(context):]
    return []


def brute_force_match(context: list[int], max_ngram: int, min_ngram: int) -> tuple[int, int] | None:
    """Reference for `NgramIndex.match`: where the latest occurrence of the longest suffix n-gram
    ends, and how many tokens before that end agree with the context's end (up to MATCH_SPAN;
    a shorter n-gram's match is exactly n long, else the longer one would have matched)."""
    for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                end = start + n
                length = n
                while (n == max_ngram and length < MATCH_SPAN and end - 1 - length >= 0
                       and context[end - 1 - length] == context[-1 - length]):
                    length += 1
                return end, length
    return None


def test_continuation_of_the_latest_match_is_proposed():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup(ctx, gamma=2) == [7, 8]  # the later "1 2 3" wins over the first


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    ctx = [5, 6, 7, 1, 4, 7, 2, 5, 6, 7]
    # "5 6 7" occurred at the start (-> 1); the more recent "7" alone would give 2
    assert lookup(ctx, gamma=1, max_ngram=3) == [1]
    assert lookup(ctx, gamma=1, max_ngram=1) == [2]


def test_no_match_and_no_self_match():
    assert lookup([1, 2, 3, 4], gamma=3) == []
    assert lookup([7], gamma=3) == []
    assert lookup([4, 4], gamma=1) == [4]  # the first 4 is followed by the second


def test_a_continuation_that_reaches_the_end_repeats_its_period():
    assert lookup([1, 2, 1], gamma=5) == [2, 1, 2, 1, 2]  # "1 2" repeating: period 2
    assert lookup([3, 4, 5, 9, 3, 4, 5], gamma=6, max_ngram=3) == [9, 3, 4, 5, 9, 3]
    assert lookup([7, 7], gamma=3) == [7, 7, 7]
    assert lookup([1, 2, 1], gamma=0) == []


def test_a_full_length_match_drafts_full_match_gamma():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    index = NgramIndex(max_ngram=3)
    index.extend(ctx)
    assert index.propose(2, full_match_gamma=5) == [4, 5, 6, 7, 8]
    assert index.propose(0, full_match_gamma=3) == [4, 5, 6]  # full-length matches only
    ctx2 = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 2, 3]  # only "2 3" matches
    index2 = NgramIndex(max_ngram=3)
    index2.extend(ctx2)
    assert index2.propose(2, full_match_gamma=5) == [4, 5]
    assert index2.propose(0, full_match_gamma=5) == []
    assert lookup([5, 6, 7], gamma=2, full_match_gamma=5) == []


def test_min_ngram_limits_short_matches():
    assert lookup([1, 9, 8, 1], gamma=2, max_ngram=3, min_ngram=2) == []
    assert lookup([1, 9, 8, 1], gamma=2, max_ngram=3, min_ngram=1) == [9, 8]


@pytest.mark.parametrize("kwargs", [{"max_ngram": 0, "min_ngram": 1}, {"max_ngram": 2, "min_ngram": 3},
                                    {"max_ngram": 2, "min_ngram": 0}])
def test_bad_ngram_sizes(kwargs):
    with pytest.raises(InvalidRequestError, match="ngram"):
        NgramIndex(**kwargs)


@settings(max_examples=80, deadline=None)
@given(
    chunks=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), min_size=1, max_size=8),
    gamma=st.integers(1, 6),
    max_ngram=st.integers(1, 4),
    full=st.one_of(st.none(), st.integers(0, 12)),
)
def test_incremental_index_equals_brute_force_after_every_append(chunks, gamma, max_ngram, full):
    index = NgramIndex(max_ngram=max_ngram, min_ngram=1)
    context: list[int] = []
    for chunk in chunks:
        index.extend(chunk)
        context.extend(chunk)
        assert index.propose(gamma, full) == brute_force(context, gamma, max_ngram, 1, full)


@settings(max_examples=80, deadline=None)
@given(
    chunks=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=8),
    gamma=st.integers(1, 6),
    max_ngram=st.integers(1, 4),
)
def test_match_length_and_the_proposal_by_match_equal_brute_force(chunks, gamma, max_ngram):
    index = NgramIndex(max_ngram=max_ngram, min_ngram=1)
    context: list[int] = []
    for chunk in chunks:
        index.extend(chunk)
        context.extend(chunk)
        found = brute_force_match(context, max_ngram, 1)
        assert index.match() == found
        want = 0 if found is None else match_gamma(gamma, found[1])
        expected = brute_force(context, want, max_ngram, 1) if want else []
        assert index.propose(gamma, by_match=True) == expected


def test_a_match_counts_back_past_max_ngram():
    ctx = [9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3, 4, 5, 6]
    index = NgramIndex(max_ngram=3)
    index.extend(ctx)
    assert index.match() == (7, 6)  # "4 5 6" found it; "1 2 3 4 5 6" agree, "9" / "8" do not
    assert index.propose(4, by_match=True) == [8, 1, 2, 3]  # 3-7 tokens long: gamma itself
    long = NgramIndex(max_ngram=3)
    long.extend(list(range(20)) * 2)  # the match runs back 20 tokens: counted up to MATCH_SPAN
    assert long.match() == (20, MATCH_SPAN)
    assert long.propose(4, by_match=True) == list(range(8))  # 2 gamma
    assert NgramIndex().match() is None


@pytest.mark.parametrize("gamma, length, expected", [
    (4, 0, 0), (4, 1, 1), (4, 2, 2), (1, 2, 1), (4, 3, 4), (4, 7, 4), (4, 8, 6), (3, 8, 5), (4, 15, 6),
    (4, 16, 8), (2, 40, 4), (0, 20, 0),
])
def test_match_gamma_drafts_by_the_match_length(gamma, length, expected):
    assert match_gamma(gamma, length) == expected


def test_generate_by_match_drafts_past_gamma_after_long_matches_and_stays_exact():
    """A prompt that repeats itself: by match length the steps draft up to 2 gamma after the
    long matches (and 1-2 tokens after short ones); by_match=False drafts gamma after every
    match. Both equal plain greedy decoding."""
    dec = Decoder(tiny_llama(seed=5))
    block = [(7 * i + 3) % VOCAB for i in range(24)]
    prompt = block * 3
    ar = dec.generate(prompt, method="ar", max_new_tokens=40).tokens
    by_match = dec.generate(prompt, method="ngram", gamma=3, max_new_tokens=40)
    plain = dec.generate(prompt, method="ngram", gamma=3, max_new_tokens=40, by_match=False)
    assert by_match.tokens == ar and plain.tokens == ar
    assert max(by_match.stats.gamma_trace) > 3 >= max(plain.stats.gamma_trace)
    with pytest.raises(InvalidRequestError, match="by_match must be true or false, got 'yes'"):
        dec.generate(prompt, method="ngram", max_new_tokens=4, by_match="yes")


@pytest.mark.parametrize("usual, length, expected", [(4, 3, 4), (4, 7, 4), (4, 8, 8), (4, 15, 8), (4, 16, 12), (2, 40, 6)])
def test_medusa_lookup_branch_length_grows_with_the_match(usual, length, expected):
    from specops.spec.medusa_branch import branch_length

    assert branch_length(usual, length) == expected


def test_medusa_lookup_branch_takes_full_matches_only_and_fits_the_step():
    """`c_branch`: no branch without a full-length match; after a long one, up to 3x the usual
    length, bounded by the budget, the context's space and the step loop's nodes beside the tree."""
    from types import SimpleNamespace

    from specops.spec.medusa_decode import c_branch

    steps, spec = SimpleNamespace(max_nodes=16), SimpleNamespace(num_nodes=4)
    short = NgramIndex()
    short.extend([1, 2, 3, 9, 8, 2, 3])  # only "2 3" recurs: no full-length match
    assert c_branch(short, steps, spec, 4, 100, 1000) is None
    long = NgramIndex()
    long.extend(list(range(20)) * 2)  # a 20-token match
    assert c_branch(long, steps, spec, 4, 100, 1000) == list(range(12))  # 3 x 4
    assert c_branch(long, steps, spec, 4, 5, 1000) == list(range(5))  # the budget
    assert c_branch(long, steps, spec, 4, 100, 10) == list(range(6))  # the context: 10 - 4 nodes
    assert c_branch(long, SimpleNamespace(max_nodes=9), spec, 4, 100, 1000) == list(range(5))  # the loop
    assert c_branch(long, steps, spec, 0, 100, 1000) is None and c_branch(None, steps, spec, 4, 100, 1000) is None
