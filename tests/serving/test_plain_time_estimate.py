"""`PlainTimeEstimate`: the plain-decoding time the engine's speed-up estimate stands on."""

from __future__ import annotations

import pytest

from specops.spec.stats import DecodeStats
from specops.engine.speedup_estimate import PlainTimeEstimate


class Seq:
    def __init__(self):
        self.stats = DecodeStats(method="draft")


class Cost:
    """A cost model whose forward of b sequences costs b units."""

    def measured(self):
        return True

    def predict(self, b, tokens):
        return float(b)


def _measured(est: PlainTimeEstimate, b: int, *steps: float) -> None:
    for s in steps:
        est.count(b, s, [], speculated=False, prefilled=False)


def test_a_speculating_step_that_shared_a_prefill_keeps_its_speculation_on_the_speculative_side():
    est = PlainTimeEstimate()
    _measured(est, 4, 0.004, 0.006)  # plain steps of 4 sequences: 5 ms
    a = Seq()
    # 30 ms step: another request's prefill, and a's draft rounds + the verification of its drafts (12 ms)
    est.count(4, 0.030, [(a, 3)], speculated=True, prefilled=True, spec_s=0.012)
    assert a.stats.decode_step_s == pytest.approx(0.030)
    # plain decoding would have paid the prefill step without the 12 ms, then two more plain steps;
    # counting the whole 30 ms as the prefill's read this step as a 1.33x speed-up, where it was 0.93x
    assert a.stats.plain_decode_s == pytest.approx(0.018 + 2 * 0.005)


def test_a_prefill_step_that_did_not_speculate_counts_as_it_was():
    est = PlainTimeEstimate()
    _measured(est, 2, 0.005)
    a = Seq()
    est.count(2, 0.030, [(a, 1)], speculated=False, prefilled=True, spec_s=0.004)  # a declined plan's time
    assert a.stats.plain_decode_s == pytest.approx(0.030)
    assert list(est.windows) == [2] and len(est.windows[2]) == 1  # a prefill step measures nothing


def test_decode_steps_count_plain_steps_per_token_and_plain_steps_measure():
    est = PlainTimeEstimate(window=2)
    a, b = Seq(), Seq()
    est.count(2, 0.010, [(a, 3)], speculated=True, prefilled=False, spec_s=0.006)
    assert a.stats.plain_decode_s == pytest.approx(0.010)  # nothing measured yet: neutral
    _measured(est, 2, 0.100, 0.004, 0.006)  # the window keeps the last two
    est.count(2, 0.012, [(a, 3), (b, 1)], speculated=True, prefilled=False, spec_s=0.006)
    assert a.stats.plain_decode_s == pytest.approx(0.010 + 3 * 0.005)
    assert b.stats.plain_decode_s == pytest.approx(0.005) and b.stats.decode_step_s == pytest.approx(0.012)


def test_an_unmeasured_batch_size_scales_the_nearest_by_the_cost_model():
    est = PlainTimeEstimate()
    assert est.plain_step_s(4) is None
    _measured(est, 2, 0.004)
    assert est.plain_step_s(8, Cost()) == pytest.approx(0.016)
    assert est.plain_step_s(8) == pytest.approx(0.004)  # no cost model: the nearest as it is


def test_bad_arguments_are_refused():
    for window in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="window"):
            PlainTimeEstimate(window)
    with pytest.raises(ValueError, match="spec_s"):
        PlainTimeEstimate().count(1, 0.01, [], speculated=True, prefilled=True, spec_s=-0.001)


def test_the_engine_reports_speculation_work_of_steps_that_shared_a_prefill():
    import torch

    from specops.decoder.api import Decoder
    from specops.engine.engine import Engine
    from specops.engine.sequence import SamplingParams, SpecSettings
    from tests.decoder.test_medusa_bundled import code_prompts

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dec = Decoder.from_pretrained("bundled")
        eng = Engine(dec, max_batch=4, kv_cache_mb=16)
        seen = []
        count = eng.accounts.plain_time.count

        def spy(b, step_s, emitted, *, speculated, prefilled, spec_s=0.0, cost=None):
            seen.append((speculated, prefilled, spec_s, step_s, sum(n for _, n in emitted)))
            return count(b, step_s, emitted, speculated=speculated, prefilled=prefilled, spec_s=spec_s, cost=cost)

        eng.accounts.plain_time.count = spy
        prompts = [p[:16] for p in code_prompts(dec, 6)]  # short: their prefill leaves the step's plan on
        spec = SpecSettings(method="draft", gamma=4, observed=True)
        for i, p in enumerate(prompts[:2]):
            eng.add(f"r{i}", p, SamplingParams(max_tokens=24), spec)
        steps = 0
        while eng.has_unfinished() and steps < 500:
            eng.step()
            steps += 1
            if steps in (3, 6, 9, 12):  # arrivals while the others speculate
                k = 2 + steps // 3 - 1
                eng.add(f"r{k}", prompts[k], SamplingParams(max_tokens=24), spec)
    finally:
        torch.set_num_threads(before)
    shared = [s for s in seen if s[0] and s[1] and s[4]]
    assert shared, seen  # speculating steps that prefilled a newcomer happened
    assert all(0 < spec_s < step_s for _, _, spec_s, step_s, _ in shared)
