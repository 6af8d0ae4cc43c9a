import math

import pytest

from specops.telemetry import DecodeRecord, WindowStats
from tests.telemetry.helpers import make_record


def test_window_from_record_derives_ratios():
    w = WindowStats.from_record(make_record())
    assert w.requests == 1
    assert w.acceptance_rate == pytest.approx(12 / 16)
    assert w.speedup == pytest.approx(1.5)
    assert w.mean_accepted_len == pytest.approx(4.0)
    assert w.tokens_per_s == pytest.approx(50.0)
    assert w.gamma == 4.0


def test_merge_sums_and_weights_settings():
    a = WindowStats.from_record(make_record(gamma=2, drafted=8, accepted=3, accepted_per_pos=[2, 1]))
    b = WindowStats.from_record(make_record(gamma=6, drafted=24, accepted=12,
                                            accepted_per_pos=[5, 4, 2, 1, 0, 0], fallback_reason="deadline"))
    m = a.merge(b)
    assert m.requests == 2
    assert m.drafted == 32 and m.accepted == 15
    assert m.accepted_per_pos == [7, 5, 2, 1, 0, 0]
    assert m.gamma == pytest.approx(4.0)
    assert m.fallbacks == {"deadline": 1}
    assert a.requests == 1 and a.accepted_per_pos == [2, 1]  # inputs unchanged


def test_head_accuracy_per_head():
    w = WindowStats.from_record(make_record(method="medusa", gamma=0, heads=3,
                                            head_predictions=[10, 10, 0], head_correct=[8, 5, 0]))
    assert w.head_accuracy == [0.8, 0.5, 0.0]


def test_empty_window_ratios_are_zero_not_errors():
    w = WindowStats()
    assert (w.acceptance_rate, w.speedup, w.tokens_per_s, w.mean_accepted_len) == (0.0, 0.0, 0.0, 0.0)
    assert not math.isnan(w.merge(WindowStats()).gamma)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"method": "beam"}, "method"),
        ({"request_class": ""}, "request_class"),
        ({"accepted": 17}, "exceeds drafted"),
        ({"accepted_per_pos": [4, 4, 3]}, "accepted_per_pos"),
        ({"wall_s": -1.0}, "wall_s"),
        ({"head_predictions": [3], "head_correct": [4]}, "head_correct"),
        ({"head_predictions": [3, 1], "head_correct": [1]}, "same length"),
    ],
)
def test_bad_records_are_rejected_with_the_field_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_record(**overrides)


def test_record_matches_interface_field_order():
    names = [f for f in DecodeRecord.__dataclass_fields__]
    assert names == ["request_class", "method", "new_tokens", "drafted", "accepted", "accepted_per_pos",
                     "target_forwards", "draft_s", "verify_s", "wall_s", "plain_s_estimate", "token_latencies_s",
                     "head_predictions", "head_correct", "gamma", "heads", "fallback_reason",
                     "drafted_per_pos", "planned"]  # additive: appended, with a default


def test_drafted_per_pos_is_checked_and_summed_like_the_accepted_counts():
    with pytest.raises(ValueError, match="drafted_per_pos sums to 5, drafted is 6"):
        make_record(drafted=6, accepted=3, accepted_per_pos=[2, 1], drafted_per_pos=[3, 2])
    with pytest.raises(ValueError, match=r"accepted_per_pos\[1\]=2 exceeds drafted_per_pos\[1\]=1"):
        make_record(drafted=6, accepted=3, accepted_per_pos=[1, 2], drafted_per_pos=[5, 1])
    a = make_record(drafted=6, accepted=3, accepted_per_pos=[2, 1], drafted_per_pos=[3, 2, 1])
    b = make_record(drafted=2, accepted=1, accepted_per_pos=[1], drafted_per_pos=[2])
    window = WindowStats.from_record(a).merge(WindowStats.from_record(b))
    assert window.drafted_per_pos == [5, 2, 1] and sum(window.drafted_per_pos) == window.drafted
    legacy = make_record(drafted=2, accepted=1, accepted_per_pos=[1])  # a source that does not report it
    mixed = WindowStats.from_record(a).merge(WindowStats.from_record(legacy))
    assert sum(mixed.drafted_per_pos) != mixed.drafted  # incomplete: the goodput model will not use it


def test_planned_requests_are_counted_and_checked():
    planned = make_record(planned=True)
    window = WindowStats.from_record(planned).merge(WindowStats.from_record(make_record()))
    assert window.planned == 1 and window.requests == 2  # a mixed window: not every request planned
    with pytest.raises(ValueError, match="planned must be a bool"):
        make_record(planned=1)
