"""The speed-up estimate of requests decoded by the batching engine.

The telemetry's speed-up is ``plain_s_estimate / wall_s``. A forward's time is shared by
the batch, so the decoder's per-forward estimate (tokens x one forward's share) put every
batched request near 1 / batch size: at 16 plain requests the records said 0.05x, and
the controller reads these to decide fallbacks. The engine now replaces each of a
request's decode steps by plain steps at the same batch size (see
`StepAccounts.count_plain_time`)."""

from __future__ import annotations

import statistics

import pytest

from specops.spec.stats import DecodeStats
from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings
from specops.telemetry import WindowStats
from tests.decoder.test_auto import bundled  # noqa: F401 (fixture: the bundled decoder on one thread)
from tests.decoder.test_medusa_bundled import code_prompts


def _speedups(eng: Engine, prompts: list[list[int]], method: str) -> list[float]:
    for i, prompt in enumerate(prompts):
        eng.add(f"{method}-{i}-{id(prompts)}", prompt, SamplingParams(max_tokens=32), SpecSettings(method=method))
    records = []
    for _ in range(10_000):
        if not eng.has_unfinished():
            break
        records += [out.record.to_record("code") for out in eng.step() if out.finished]
    assert len(records) == len(prompts)
    return [WindowStats.from_record(r).speedup for r in records]


def test_plain_requests_at_batch_8_are_estimated_near_one(bundled):
    eng = Engine(bundled, max_batch=8, kv_cache_mb=32)
    prompts = code_prompts(bundled, 8)
    _speedups(eng, prompts, "ar")  # measures plain steps at these batch sizes
    speedups = _speedups(eng, prompts, "ar")
    # plain decoding against itself: 1.0 up to the machine's step-time jitter (it was ~0.11 for every
    # request); a median and a loose floor, so one request caught in a load spike cannot fail it
    assert 0.6 < statistics.median(speedups) < 1.6, speedups
    assert min(speedups) > 0.3, speedups


def test_count_plain_time_replaces_decode_steps_by_plain_steps_at_the_same_batch_size(bundled):
    eng = Engine(bundled, max_batch=4, kv_cache_mb=8, calibrate=False)

    class Seq:
        def __init__(self):
            self.stats = DecodeStats(method="ngram")

    a, b = Seq(), Seq()
    eng.accounts.count_plain_time(2, 0.010, [(a, 1), (b, 1)], speculated=True, prefilled=False)
    assert a.stats.plain_decode_s == pytest.approx(0.010)  # nothing measured yet: neutral
    for s in (0.004, 0.006):  # two all-plain steps of 2 sequences: 5 ms on average
        eng.accounts.count_plain_time(2, s, [], speculated=False, prefilled=False)
    eng.accounts.count_plain_time(2, 0.007, [(a, 3), (b, 1)], speculated=True, prefilled=False)
    assert a.stats.decode_step_s == pytest.approx(0.017)
    assert a.stats.plain_decode_s == pytest.approx(0.010 + 3 * 0.005)  # 3 tokens: 3 plain steps
    assert b.stats.plain_decode_s == pytest.approx(0.010 + 0.005)
    eng.accounts.count_plain_time(2, 0.030, [(a, 2)], speculated=True, prefilled=True)  # another request's prefill ran too
    assert a.stats.plain_decode_s == pytest.approx(0.025 + 0.030 + 0.005)
    assert list(eng.accounts.plain_step) == [2]  # only the all-plain, prefill-free steps were measured

    a.stats.new_tokens, a.stats.wall_s = 7, 0.100  # 0.053 of it outside decode steps (queue, prefill)
    record = a.stats.to_record("code")
    assert record.plain_s_estimate == pytest.approx(0.100 - 0.047 + 0.060)
    assert WindowStats.from_record(record).speedup == pytest.approx(1.13)


def test_records_outside_the_engine_keep_the_per_token_estimate():
    stats = DecodeStats(method="ngram", new_tokens=10, verify_s=0.02, target_forwards=4, wall_s=0.05)
    stats.plain_token_s = 0.004
    assert stats.to_record("code").plain_s_estimate == pytest.approx(0.04)
    stats.plain_decode_s, stats.decode_step_s = 0.01, 0.02
    assert stats.to_record("code", plain_token_s=0.003).plain_s_estimate == pytest.approx(0.03)  # explicit wins
