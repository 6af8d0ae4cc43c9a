"""Prompt-lookup drafting: longest and most recent match, never the suffix itself."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specops.decoder.errors import InvalidRequestError
from specops.decoder.ngram import NgramIndex, lookup


def brute_force(context: list[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Reference: scan for the latest earlier occurrence of the longest suffix n-gram."""
    for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # occurrence must end before the last token
            if context[start : start + n] == suffix:
                return context[start + n : start + n + gamma]
    return []


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
    assert lookup([4, 4], gamma=3) == [4]  # the first 4 is followed by the second


def test_short_continuations_and_zero_gamma():
    assert lookup([1, 2, 1], gamma=5) == [2, 1]  # only two tokens follow the match
    assert lookup([1, 2, 1], gamma=0) == []


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
)
def test_incremental_index_equals_brute_force_after_every_append(chunks, gamma, max_ngram):
    index = NgramIndex(max_ngram=max_ngram, min_ngram=1)
    context: list[int] = []
    for chunk in chunks:
        index.extend(chunk)
        context.extend(chunk)
        assert index.propose(gamma) == brute_force(context, gamma, max_ngram, 1)
