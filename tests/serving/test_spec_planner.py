"""The planner's objective with measured proposal costs: speculation is chosen only when
its expected goodput beats plain decoding by the margin, per sequence or for the whole
batch; the cost measurements shrug off spikes. Costs are synthetic, so every plan here
is deterministic."""

from __future__ import annotations

import pytest
import torch

from specops.decoder import Decoder
from specops.models.medusa_heads import MedusaHeads
from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings
from specops.engine.spec_planner import Candidate, CostModel, Meter, linear_gains, plan
from tests.decoder.tiny_models import perturbed, tiny_other


class LineCost(CostModel):
    """seconds = base + per_token * (t - b) (+ per_seq * b): a chosen, noiseless cost."""

    def __init__(self, base: float, per_token: float, per_seq: float = 0.0) -> None:
        super().__init__()
        self.base, self.per_token, self.per_seq = base, per_token, per_seq

    def predict(self, b: int, t: int) -> float:
        return self.base + self.per_seq * b + self.per_token * max(t - b, 0)


VERIFY = LineCost(10e-3, 0.1e-3)  # batch 1: extra verified tokens are nearly free


def test_cheap_proposals_speculate_up_to_the_bound():
    assert plan([Candidate(gains=linear_gains(0.8, 5))], VERIFY, batch=1, base_tokens=1) == [5]
    cheap_draft = LineCost(0.3e-3, 0.0)  # a draft round costs 3% of a verify
    got = plan([Candidate(gains=linear_gains(0.8, 5), draft_rounds=True)], VERIFY, batch=1, base_tokens=1,
               draft_cost=cheap_draft)
    assert got[0] >= 3


def test_an_expensive_draft_model_switches_speculation_off():
    # each draft round costs as much as the verify forward: 1 + 0.7 tokens for 2 forwards is a loss
    dear = LineCost(10e-3, 0.0)
    got = plan([Candidate(gains=linear_gains(0.7, 6), draft_rounds=True)], VERIFY, batch=1, base_tokens=1,
               draft_cost=dear)
    assert got == [0]
    # the same candidate without the draft cost charged would speculate: the charge is what decides
    assert plan([Candidate(gains=linear_gains(0.7, 6), draft_rounds=True)], VERIFY, batch=1, base_tokens=1)[0] > 0


def test_draft_gamma_shrinks_as_rounds_get_dearer():
    gammas = []
    for round_s in (0.2e-3, 2e-3, 5e-3):
        got = plan([Candidate(gains=linear_gains(0.8, 8), draft_rounds=True)], VERIFY, batch=1, base_tokens=1,
                   draft_cost=LineCost(round_s, 0.0))
        gammas.append(got[0])
    assert gammas[0] > gammas[1] > gammas[2] >= 1


def test_per_sequence_overhead_makes_speculation_a_loss():
    # proposal + verification overhead of 15 ms per speculating sequence against a 10 ms step
    dear = [Candidate(gains=linear_gains(0.6, 4), overhead_s=15e-3)]
    assert plan(dear, VERIFY, batch=1, base_tokens=1) == [0]
    cheap = [Candidate(gains=linear_gains(0.6, 4), overhead_s=0.2e-3)]
    assert plan(cheap, VERIFY, batch=1, base_tokens=1)[0] > 0


def test_overhead_picks_which_sequences_speculate_in_a_batch():
    # batch of 4: per-token verify cost is moderate; overhead per speculating sequence 2 ms
    cost = LineCost(10e-3, 1e-3)
    cands = [Candidate(gains=linear_gains(0.9, 4), overhead_s=2e-3)] + [
        Candidate(gains=linear_gains(0.15, 4), overhead_s=2e-3) for _ in range(3)]
    got = plan(cands, cost, batch=4, base_tokens=4)
    assert got[0] > 0 and got[1:] == [0, 0, 0]  # only the good acceptor pays for its overhead


def test_batched_draft_rounds_are_charged_once_per_round_not_per_sequence():
    # 8 sequences drafting: one batched round costs 1 ms whatever its width
    cost = LineCost(10e-3, 0.2e-3)
    cands = [Candidate(gains=linear_gains(0.8, 4), draft_rounds=True) for _ in range(8)]
    got = plan(cands, cost, batch=8, base_tokens=8, draft_cost=LineCost(1e-3, 0.0))
    assert all(g > 0 for g in got)
    # if every sequence cost a round of its own (per_seq), drafting the whole batch would not pay as much
    per_seq = plan(cands, cost, batch=8, base_tokens=8, draft_cost=LineCost(0.0, 0.0, per_seq=4e-3))
    assert sum(per_seq) < sum(got)


def test_margin_keeps_marginal_gains_out():
    # speculation worth about +2% expected tokens/s: inside the default 3% margin
    c = [Candidate(gains=[0.12], overhead_s=0.0)]
    cost = LineCost(10e-3, 1e-3)
    assert plan(c, cost, batch=1, base_tokens=1) == [0]
    assert plan(c, cost, batch=1, base_tokens=1, margin=0.0) == [1]


def test_fixed_host_time_counts_in_the_rate():
    # the same 5 ms per-sequence overhead: a loss on a bare 10 ms step, a gain once the step
    # also carries 30 ms of host time that plain decoding pays as well
    c = [Candidate(gains=linear_gains(0.3, 2), overhead_s=5e-3)]
    assert plan(c, VERIFY, batch=1, base_tokens=1) == [0]
    assert plan(c, VERIFY, batch=1, base_tokens=1, fixed_s=30e-3)[0] > 0


def test_meter_and_cost_model_ignore_spikes():
    m = Meter(window=5)
    for v in (1.0, 1.1, 50.0, 0.9, 1.0):
        m.observe(v)
    assert m.value() == 1.0
    cost = CostModel()
    for t in (1, 3, 5):
        for k in range(5):
            cost.observe(1, t, 10e-3 + 1e-3 * t + (0.5 if (k == 2 and t == 3) else 0.0))  # one 0.5 s spike
    assert abs(cost.predict(1, 3) - 13e-3) < 1e-6


def test_a_cost_point_not_measured_again_lately_leaves_the_fit_until_it_is():
    """A (B, T) point measured in a load spike and never again (the planner declined the plans it
    priced) stops pricing extra tokens after `max_age` observations at its batch size; the fresh
    points' last segment prices them until the point is measured again, and then it counts."""
    cost = CostModel(max_age=50, refit_every=1)
    for _ in range(5):
        cost.observe(4, 4, 4e-3)
        cost.observe(4, 8, 5e-3)
        cost.observe(4, 12, 20e-3)  # the spike
    assert cost.predict(4, 12) == pytest.approx(20e-3)
    for _ in range(30):
        cost.observe(4, 4, 4e-3)
        cost.observe(4, 8, 5e-3)
    # 60 observations at B=4 since (4, 12)'s last: left out, priced by (4, 4)-(4, 8)'s slope
    assert cost.predict(4, 12) == pytest.approx(6e-3)
    assert cost.predict(2, 12) == cost.predict(4, 12)  # the only batch size measured prices the others
    for _ in range(60):
        cost.observe(4, 4, 4e-3)  # ages (4, 8) out as well: one fresh point, a flat curve
    assert cost.predict(4, 12) == pytest.approx(4e-3)
    cost.observe(4, 12, 7e-3)  # measured again: back in the fit with its whole window
    assert cost.predict(4, 12) == pytest.approx(20e-3)
    for _ in range(5):
        cost.observe(4, 12, 7e-3)
    assert cost.predict(4, 12) == pytest.approx(7e-3)


def test_tokens_past_the_last_point_are_never_priced_free():
    """A noisy far point pools the curve's end flat (isotonic): a server's startup calibration read
    (4, 12) at 2.91 ms and (4, 20) at 2.56. Past the last point the slope is at least the curve's
    mean slope, so a plan at batch 4 reaching T = 44 (γ 10 each) no longer costs what T = 12 does,
    and a plan over it stops looking profitable."""
    cost = CostModel()
    for _ in range(5):
        cost.observe(4, 4, 1.95e-3)
        cost.observe(4, 12, 2.91e-3)
        cost.observe(4, 20, 2.56e-3)
    flat = cost.predict(4, 20)
    assert cost.predict(4, 12) == pytest.approx(flat)  # pooled: inside the curve it stays as measured
    mean_slope = (flat - 1.95e-3) / 16
    assert cost.predict(4, 44) == pytest.approx(flat + 24 * mean_slope)
    gains = [linear_gains(0.7, 10)] * 4  # four sequences drafting 10 tokens at acceptance 0.7
    chosen = plan([Candidate(gains=g) for g in gains], cost, batch=4, base_tokens=4)
    assert sum(chosen) < 40, chosen
    steep = CostModel()  # a last segment steeper than the mean keeps its own slope
    for _ in range(5):
        steep.observe(4, 4, 2e-3)
        steep.observe(4, 12, 2.2e-3)
        steep.observe(4, 20, 4e-3)
    assert steep.predict(4, 28) == pytest.approx(4e-3 + 8 * (1.8e-3 / 8))


def test_a_long_draft_cache_catch_up_is_not_counted_as_speculations_recurring_cost(qwen2):
    """`Engine._note_catch_up`: a first drafting round that fed more than FULL_CATCH_UP tokens to some
    sequence cost its seconds beyond the same round capped at FULL_CATCH_UP per sequence; that part
    is left out of what the calibration and the veto read. Shorter feeds leave nothing out."""
    from types import SimpleNamespace

    from specops.engine.plan_limits import FULL_CATCH_UP

    eng = Engine(qwen2, max_batch=2, kv_cache_mb=1, calibrate=False)
    eng.draft_cost = LineCost(1e-3, 0.1e-3)
    seqs = [SimpleNamespace(tokens=list(range(60))), SimpleNamespace(tokens=list(range(30)))]
    eng._note_catch_up(seqs, [58, 27], [2e-3, 1e-3], wall_s=4e-3, cost_s=8e-3)
    assert eng._catch_up == (0.0, 0.0)  # 2 and 3 tokens behind: an ordinary first round
    eng._note_catch_up(seqs, [0, 28], [9e-3, 1e-3], wall_s=6e-3, cost_s=12e-3)  # 60 tokens behind
    usual = 1e-3 + 0.1e-3 * (FULL_CATCH_UP + 2 - 2)
    assert eng._catch_up[0] == pytest.approx(9e-3 - usual)
    assert eng._catch_up[1] == pytest.approx((9e-3 - usual) * 0.5)  # on the wall clock: wall / cost

    calls = []
    eng.calibration = SimpleNamespace(observe_spec=lambda b, real, *a, **k: calls.append((real, k["wall_s"])),
                                      observe_plain=lambda *a, **k: None, losing=lambda b: False,
                                      scale=lambda b: 1.0)
    # speculation always pays, and a round that feeds the 36-token prompt costs more than the 1 us
    # this line charges any round of up to FULL_CATCH_UP tokens (the tiny model's real forward
    # of 36 tokens took less than the 0.1 ms it charged before, on the panel kernel)
    eng.cost, eng.draft_cost = LineCost(10e-3, 0.1e-3), LineCost(1e-6, 0.0)
    eng.schedule.probe_every = 0
    eng.add("r", [3, 4, 5] * 12, SamplingParams(max_tokens=8), SpecSettings(method="draft", gamma=3))
    seen = []
    note = eng._note_catch_up
    eng._note_catch_up = lambda *a: (note(*a), seen.append(eng._catch_up))
    _drain(eng)
    assert seen and seen[0][0] > 0  # the first drafting round fed the whole 36-token prompt
    assert all(c == (0.0, 0.0) for c in seen[1:])


@pytest.fixture(scope="module")
def qwen2():
    torch.set_num_threads(1)
    target = tiny_other("qwen2", seed=5, vocab=96)
    draft = perturbed(target, noise=0.3, seed=6)
    return Decoder(target, draft=draft, medusa=MedusaHeads.from_model(target, 3))


def _run(dec: Decoder, method: str, verify: CostModel, draft: CostModel, n: int = 3):
    eng = Engine(dec, max_batch=4, kv_cache_mb=1, calibrate=False)
    eng.cost, eng.draft_cost = verify, draft
    eng.calibration = None  # synthetic costs: real step times would "calibrate" them
    eng.schedule.probe_every = 0  # the planner's own choice, without cost probes
    prompt = [3, 4, 5] * 5
    for i in range(n):
        eng.add(f"r{i}", prompt, SamplingParams(max_tokens=16), SpecSettings(method=method, gamma=4))
    got, records = {}, []
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                records.append(o.record)
    want = dec.generate(prompt, method="ar", max_new_tokens=16, eos_token_id=None).tokens
    return got, records, want


def test_engine_drafts_only_when_the_measured_draft_cost_allows(qwen2):
    # a verify step of 1 s, so the engine's own measured host overheads (ms) do not matter
    slow_verify = LineCost(1.0, 1e-3)
    got, records, want = _run(qwen2, "draft", slow_verify, LineCost(2.0, 0.0))  # a draft round: 2 s
    assert all(r.drafted == 0 and r.draft_forwards == 0 for r in records)  # never drafted: a loss
    assert all(g == want for g in got.values())
    got, records, want = _run(qwen2, "draft", slow_verify, LineCost(1e-3, 0.0))  # a draft round: 1 ms
    assert all(r.drafted > 0 for r in records)
    assert all(g == want for g in got.values())


def test_cost_near_the_batch_width_is_not_bent_by_far_points():
    cost = CostModel()
    for t, sec in ((16, 50e-3), (48, 80e-3), (400, 120e-3)):  # a far, flat point (e.g. a long forward)
        cost.observe(16, t, sec)
    assert abs(cost.predict(16, 32) - 65e-3) < 1e-9  # between its neighbours, not on a global line
    assert abs(cost.predict(16, 16) - 50e-3) < 1e-9


def test_a_noisy_low_point_is_averaged_not_copied_onto_larger_forwards():
    cost = CostModel()
    for t, sec in ((16, 40e-3), (48, 20e-3), (80, 30e-3)):  # T = 16 came out too dear
        cost.observe(16, t, sec)
    assert cost.predict(16, 16) == cost.predict(16, 48) == pytest.approx(30e-3)  # pooled, not 40 ms flat
    assert cost.predict(16, 80) == pytest.approx(30e-3)
    assert cost.predict(16, 200) >= cost.predict(16, 80)


def test_a_shapes_first_forward_is_not_its_cost():
    """With warmup=1 the first observation of each (B, T) (one-time kernel builds) is dropped."""
    cost = CostModel(warmup=1)
    cost.observe(1, 1, 0.004)
    cost.observe(1, 1, 0.004)
    cost.observe(1, 7, 0.300)  # the first T=7 forward: oneDNN builds its kernels
    assert (1, 7) not in cost.points
    cost.observe(1, 7, 0.005)
    assert cost.points == {(1, 1): 0.004, (1, 7): 0.005}


def test_cached_medians_follow_every_observation():
    """Meter and CostModel keep their medians between observations (read per sequence and per
    step): after each observation, stale-point drops included, they equal a fresh median."""
    import random
    import statistics

    rng = random.Random(5)
    meter, cost = Meter(window=5), CostModel(window=3)
    for i in range(300):
        meter.observe(rng.random())
        assert meter.value() == statistics.median(meter.values)
        b, t = rng.choice([1, 4]), rng.choice([1, 2, 3, 5, 8])
        spike = 10.0 if i % 37 == 0 else 1.0  # now and then a point far above its neighbours, later dropped
        cost.observe(b, b * t, spike * 1e-3 * (1 + 0.1 * t) * (0.9 + 0.2 * rng.random()))
        assert cost.points == {k: statistics.median(v) for k, v in cost.samples.items()}
    assert meter.value(default=7.0) == statistics.median(meter.values) and Meter().value(default=7.0) == 7.0


def test_the_first_draft_round_is_charged_for_the_tokens_it_feeds():
    """A draft round after skipped steps feeds the committed tokens its draft cache lacks: the plan
    prices that round at its real width (`Candidate.first_feed`), not one token per sequence."""
    rounds = LineCost(0.3e-3, 2e-3)  # a draft round: 0.3 ms, plus 2 ms per token beyond one per sequence
    fresh = Candidate(gains=linear_gains(0.8, 5), draft_rounds=True)
    lagging = Candidate(gains=linear_gains(0.8, 5), draft_rounds=True, first_feed=16)
    assert plan([fresh], VERIFY, batch=1, base_tokens=1, draft_cost=rounds)[0] > 0
    assert plan([lagging], VERIFY, batch=1, base_tokens=1, draft_cost=rounds) == [0]  # 30 ms to catch up
    # in a batch the first round is one forward over every drafting sequence's feed: 2 tokens
    # (0.3 ms) for two fresh sequences, 16 (28 ms) for two that skipped 7 steps
    verify = LineCost(10e-3, 0.1e-3)
    assert all(plan([fresh, fresh], verify, batch=2, base_tokens=2, draft_cost=rounds))
    lagging8 = Candidate(gains=linear_gains(0.8, 5), draft_rounds=True, first_feed=8)
    assert plan([lagging8, lagging8], verify, batch=2, base_tokens=2, draft_cost=rounds) == [0, 0]
    # a fresh and a lagging sequence: the fresh one drafts alone (by its gains alone the lagging one
    # joins early, and the best prefix of that order had both drafting, at a third less goodput)
    mixed = plan([fresh, lagging8], verify, batch=2, base_tokens=2, draft_cost=rounds)
    assert mixed[0] > 0 and mixed[1] == 0


def _drain(eng: Engine) -> dict:
    """Step ``eng`` until every request finished; their records by request id."""
    records = {}
    while eng.has_unfinished():
        records.update((o.request_id, o.record) for o in eng.step() if o.finished)
    return records


def test_plain_probes_remeasure_the_plain_step_while_everything_speculates(qwen2):
    """While every step at a batch size speculates, every `plain_probe_every`-th one decodes
    plainly: the plain (B, B) forward the plans compare against is measured again."""
    eng = Engine(qwen2, max_batch=2, kv_cache_mb=1, calibrate=False)
    # speculation always pays, and a round that feeds the 36-token prompt costs more than the 1 us
    # this line charges any round of up to FULL_CATCH_UP tokens (the tiny model's real forward
    # of 36 tokens took less than the 0.1 ms it charged before, on the panel kernel)
    eng.cost, eng.draft_cost = LineCost(10e-3, 0.1e-3), LineCost(1e-6, 0.0)
    eng.calibration = None
    eng.schedule.plain_probe_every = 5
    eng.margin = -1.0  # every candidate speculates, whatever the random draft's acceptance (a declined step ends a run)
    seen = []
    observe = eng.cost.observe
    eng.cost.observe = lambda b, t, s: (seen.append((b, t)), observe(b, t, s))
    eng.add("r", [3, 4, 5] * 6, SamplingParams(max_tokens=60), SpecSettings(method="draft", gamma=4))
    trace = _drain(eng)["r"].gamma_trace
    assert eng.schedule.plain_probes >= 2
    assert seen.count((1, 1)) >= eng.schedule.plain_probes  # each probe measured a plain step
    runs = "".join("s" if g else "p" for g in trace).split("p")
    assert max(len(r) for r in runs) == 5  # speculating, but never more than plain_probe_every steps in a row


def test_probes_back_off_while_they_confirm_the_decline():
    """A probe whose verify cost came out as predicted doubles the wait for the next (up to
    PROBE_BACKOFF_MAX periods); one that found the cost model stale, or a plan that
    speculates by itself, brings the short period back."""
    from specops.engine.plan_limits import PROBE_BACKOFF_MAX

    eng = Engine(Decoder.from_pretrained("bundled"), max_batch=2, kv_cache_mb=1, calibrate=False)
    eng.cost = LineCost(10e-3, 1e-3)
    eng.schedule.probe_every = 4
    assert eng.schedule.probe_due(4) and not eng.schedule.probe_due(3)
    for want in (2, 4, 8, 8):
        predicted = eng.cost.predict(1, 3)
        eng.schedule.after_probe(predicted, forward_s=0.95 * predicted)  # as predicted: the decline stands
        assert eng.schedule.probe_backoff == min(want, PROBE_BACKOFF_MAX)
    assert not eng.schedule.probe_due(4 * 8 - 1) and eng.schedule.probe_due(4 * 8)
    eng.schedule.after_probe(eng.cost.predict(1, 3), forward_s=0.2 * eng.cost.predict(1, 3))  # far cheaper: stale
    assert eng.schedule.probe_backoff == 1 and eng.schedule.probe_due(4)


def test_a_draft_rounds_measured_cost_includes_its_host_work(qwen2, monkeypatch):
    """The draft rounds' cost model times each round's forward AND its host work (each sampled
    sequence's probabilities and draw): that work grows with the tokens drafted, and timed apart
    as a per-sequence overhead the plan missed it."""
    import time

    from specops.spec import draft  # the drafting rounds' rule, which the engine's draft model drafts by

    draw = draft.sample

    def slow_sample(q, generator):  # 4 ms of CPU per draw (the planner's clock counts CPU time)
        end = time.process_time() + 4e-3
        while time.process_time() < end:
            pass
        return draw(q, generator)

    monkeypatch.setattr(draft, "sample", slow_sample)
    eng = Engine(qwen2, max_batch=2, kv_cache_mb=1, calibrate=False)
    # speculation always pays, and a round that feeds the 36-token prompt costs more than the 1 us
    # this line charges any round of up to FULL_CATCH_UP tokens (the tiny model's real forward
    # of 36 tokens took less than the 0.1 ms it charged before, on the panel kernel)
    eng.cost, eng.draft_cost = LineCost(10e-3, 0.1e-3), LineCost(1e-6, 0.0)
    eng.calibration = None
    rounds = []
    eng.draft_cost.observe = lambda b, t, s: rounds.append(s)
    # a top-p filter keeps drafting on the per-round loop (the C chain draws softmax(logits / T) alone,
    # inside the rounds it times)
    eng.add("r", [3, 4, 5] * 6, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1),
            SpecSettings(method="draft", gamma=3))
    assert _drain(eng)["r"].drafted > 0
    assert rounds and min(rounds) >= 4e-3  # every round drew once and paid for it


def test_calibration_reads_the_real_extra_cost_of_speculating():
    """`SpecCalibration.scale`: the real extra seconds of speculative steps over their predicted
    extra, both against plain steps' real-over-predicted ratio; 1 until both kinds have enough
    samples at that batch size; clamped."""
    from specops.engine.spec_planner import SpecCalibration

    cal = SpecCalibration(min_spec=4, min_plain=2)
    for _ in range(3):
        cal.observe_plain(4, 0.8 * 10e-3, 10e-3)  # plain steps run at 0.8 of their prediction
        cal.observe_spec(4, 0.8 * 10e-3 + 2 * 4e-3, 10e-3 + 4e-3, 10e-3)  # the extra 4 ms really costs 8 ms
    assert cal.scale(4) == 1.0  # 3 speculative samples of the 4 it needs
    cal.observe_spec(4, 0.8 * 10e-3 + 2 * 4e-3, 10e-3 + 4e-3, 10e-3)
    assert cal.scale(4) == pytest.approx(2.0 / 0.8)  # twice the extra, against plain steps 20% cheaper
    assert cal.scale(2) == 1.0  # nothing measured at batch 2
    for _ in range(8):
        cal.observe_spec(4, 1.0, 10e-3 + 4e-3, 10e-3)  # a second per step: the clamp
    assert cal.scale(4) == cal.hi


def test_a_spec_scale_prices_every_speculative_plan():
    c = [Candidate(gains=linear_gains(0.7, 4))]
    cost = LineCost(10e-3, 2e-3)
    out = {}
    assert plan(c, cost, batch=1, base_tokens=1, out=out)[0] > 0
    assert out["plain_s"] == pytest.approx(10e-3) and out["step_s"] > out["plain_s"]  # unscaled seconds
    assert plan(c, cost, batch=1, base_tokens=1, spec_scale=4.0) == [0]  # each drafted token really costs 8 ms
    assert plan(c, cost, batch=1, base_tokens=1, spec_scale=4.0, margin=-1.0)[0] > 0  # a probe still runs


def test_the_engine_records_each_decode_step_for_the_calibration(qwen2):
    eng = Engine(qwen2, max_batch=2, kv_cache_mb=1, calibrate=False)
    # speculation always pays, and a round that feeds the 36-token prompt costs more than the 1 us
    # this line charges any round of up to FULL_CATCH_UP tokens (the tiny model's real forward
    # of 36 tokens took less than the 0.1 ms it charged before, on the panel kernel)
    eng.cost, eng.draft_cost = LineCost(10e-3, 0.1e-3), LineCost(1e-6, 0.0)
    eng.schedule.plain_probe_every = 3
    eng.schedule.probe_every = 0  # a cost probe's step is left out of the calibration (its catch-up is its own)
    # every candidate speculates, whatever the random draft's acceptance (as it falls, the plan declined
    # more steps, each ending a speculative run: the probes, every 3rd step of a run, came 1 or 2)
    eng.margin = -1.0
    eng.add("r", [3, 4, 5] * 6, SamplingParams(max_tokens=40), SpecSettings(method="draft", gamma=4))
    record = _drain(eng)["r"]
    spec, plain = eng.calibration.spec[1], eng.calibration.plain[1]
    assert len(spec) == sum(g > 0 for g in record.gamma_trace)  # every speculative decode step ...
    assert len(plain) >= eng.schedule.plain_probes >= 2  # ... and the plain ones (probes; the prompt's step is a prefill)
    assert all(real > 0 and predicted > plain_predicted for real, predicted, plain_predicted in spec)


def test_realized_rates_flag_speculation_that_made_decoding_slower():
    from specops.engine.spec_planner import SpecCalibration

    cal = SpecCalibration(min_plain=2, guard_window=4)
    for _ in range(3):
        cal.observe_plain(4, 10e-3, 9e-3, tokens=4, wall_s=10e-3)  # 400 tokens/s plainly
    for _ in range(3):
        cal.observe_spec(4, 20e-3, 14e-3, 9e-3, tokens=9, wall_s=25e-3)  # 360 tokens/s speculating (wall)
    assert not cal.losing(4)  # 3 of the 4 speculative steps it judges on
    cal.observe_spec(4, 20e-3, 14e-3, 9e-3, tokens=9, wall_s=25e-3)
    assert cal.losing(4)
    cal.forget_spec(4)
    assert not cal.losing(4)  # judged afresh from the next full window
    for _ in range(4):
        cal.observe_spec(4, 20e-3, 14e-3, 9e-3, tokens=9, wall_s=20e-3)  # 450 tokens/s: speculation pays
    assert not cal.losing(4)


def test_the_engine_decodes_plainly_where_speculating_was_slower(qwen2):
    """Where the last speculative steps at a batch size emitted fewer tokens per second than its
    plain steps, the engine stops planning there for `veto_steps` steps, then judges afresh; at
    batch 1 the requests' own plans decide."""
    eng = Engine(qwen2, max_batch=2, kv_cache_mb=1, calibrate=False)
    eng.cost, eng.draft_cost = LineCost(10e-3, 0.1e-3), LineCost(0.1e-3, 0.0)  # the plan: speculation pays
    eng.calibration.losing = lambda b: True  # the record: it did not
    eng.schedule.veto_steps = 6
    for i in range(2):
        eng.add(f"r{i}", [3, 4, 5] * 6, SamplingParams(max_tokens=40), SpecSettings(method="draft", gamma=4))
    records = _drain(eng)
    assert eng.schedule.vetoes >= 2
    for r in records.values():
        runs = "".join("s" if g else "p" for g in r.gamma_trace).split("s")
        assert max(len(run) for run in runs) >= 6  # a veto's plain steps in a row
        assert sum(g > 0 for g in r.gamma_trace) >= 2  # and speculation tried again after it
    eng.add("alone", [3, 4, 5] * 6, SamplingParams(max_tokens=20), SpecSettings(method="draft", gamma=4))
    vetoes = eng.schedule.vetoes
    _drain(eng)
    assert eng.schedule.vetoes == vetoes and not eng.schedule.veto.get(1)  # batch 1: never vetoed, each request's plan decides


def test_the_veto_spares_requests_whose_speculation_is_measured(qwen2):
    """A canary's or a fallback probe's request (`SpecSettings.observed`) keeps speculating through a
    veto, so the acceptance the canary analysis reads does not go blind; the others decode plainly."""
    # no prefix cache: with it, the second of two equal prompts is admitted a step later to reuse the
    # first's blocks (`Scheduler._shares_uncached`), and its prefill then shares the stable request's
    # first speculative step, which the calibration (and so the veto) skips
    eng = Engine(qwen2, max_batch=2, kv_cache_mb=1, calibrate=False, prefix_caching=False)
    eng.cost, eng.draft_cost = LineCost(10e-3, 0.1e-3), LineCost(0.1e-3, 0.0)  # the plan: speculation pays
    eng.calibration.losing = lambda b: True  # the record: it did not
    eng.schedule.veto_steps = 1000  # longer than the requests: once vetoed, batch 2 stays vetoed
    eng.schedule.plain_probe_every = 0
    eng.margin = -1.0  # every candidate speculates, whatever the random draft's acceptance
    eng.add("stable", [3, 4, 5] * 6, SamplingParams(max_tokens=40), SpecSettings(method="draft", gamma=4))
    eng.add("canary", [3, 4, 5] * 6, SamplingParams(max_tokens=40),
            SpecSettings(method="draft", gamma=4, observed=True))
    records = _drain(eng)
    assert eng.schedule.vetoes == 1
    stable, canary = records["stable"].gamma_trace, records["canary"].gamma_trace
    first = next(i for i, g in enumerate(stable) if g) + 1  # the step whose record started the veto
    assert not any(stable[first:]) and all(canary[first:-1])  # (its last step has one token left to emit)
    assert records["canary"].drafted > records["stable"].drafted > 0
    with pytest.raises(ValueError, match="observed"):
        SpecSettings(method="draft", observed="yes").check()


def test_a_forced_candidate_takes_all_its_gains_and_the_others_are_planned_around_it():
    """`Candidate.forced` (a request whose speculation is measured) speculates its whole bound
    where the plan would decline; the other candidates are still planned, with its cost counted."""
    dear = LineCost(10e-3, 0.0)  # a draft round costs a verify forward: drafting is a loss
    hopeless = Candidate(gains=linear_gains(0.05, 6), draft_rounds=True)
    assert plan([hopeless], VERIFY, batch=1, base_tokens=1, draft_cost=dear) == [0]
    forced = Candidate(gains=linear_gains(0.05, 6), draft_rounds=True, forced=True)
    assert plan([forced], VERIFY, batch=1, base_tokens=1, draft_cost=dear) == [6]
    # an empty proposal (an n-gram lookup without a match) has nothing to force
    assert plan([Candidate(gains=[], forced=True)], VERIFY, batch=1, base_tokens=1) == [0]
    # beside it, a good n-gram proposal is still chosen by its gains, and a poor one still declined
    good, poor = Candidate(gains=linear_gains(0.9, 4)), Candidate(gains=linear_gains(0.01, 4), overhead_s=5e-3)
    got = plan([forced, good, poor], VERIFY, batch=3, base_tokens=3, draft_cost=dear)
    assert got[0] == 6 and got[1] == 4 and got[2] == 0


def test_an_observed_request_speculates_as_set_where_the_plan_declines(qwen2):
    """A canary's or a fallback probe's request (`SpecSettings.observed`) drafts its gamma at every
    step the plan would decline (a draft round priced at 2 s), so the analysis measures the setting
    under test; the same request unobserved never drafts. Both outputs stay exact."""
    records = {}
    for observed in (False, True):
        eng = Engine(qwen2, max_batch=2, kv_cache_mb=1, calibrate=False)
        eng.cost, eng.draft_cost = LineCost(1.0, 1e-3), LineCost(2.0, 0.0)
        eng.calibration = None
        eng.schedule.probe_every = 0
        eng.schedule.plain_probe_every = 0
        for method in ("draft", "ngram"):
            eng.add(f"{method}-{observed}", [3, 4, 5] * 6, SamplingParams(max_tokens=24),
                    SpecSettings(method=method, gamma=3, observed=observed))
        got: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    records[o.request_id] = o.record
        want = qwen2.generate([3, 4, 5] * 6, method="ar", max_new_tokens=24, eos_token_id=None).tokens
        assert all(tokens == want for tokens in got.values())
    assert records["draft-False"].drafted == 0
    trace = records["draft-True"].gamma_trace
    # every decode step drafts 3, then 2, 1 and 0 as the budget's end bounds it
    assert len(trace) > 6 and set(trace[:-3]) == {3} and trace[-3:] == [2, 1, 0], str(trace)
    assert records["ngram-True"].drafted > 0  # the repeated prompt gives the lookup its matches


def test_the_plans_early_stop_changes_no_plan():
    """`plan` stops once no longer plan can beat its best (tokens left over growing seconds); its
    choice equals the best of every prefix of the greedy order, each priced by `_rate`, on random
    batches of n-gram, draft and Medusa candidates and random measured cost curves."""
    import heapq
    import random as rnd

    from specops.engine.spec_planner import _rate

    rng = rnd.Random(5)
    for trial in range(300):
        verify, draft = CostModel(), CostModel()
        b = rng.randint(1, 12)
        for bb in {1, b, rng.randint(1, 16)}:
            base = rng.uniform(2e-3, 20e-3)
            for t in sorted(rng.sample(range(bb, bb + 60), 4)):
                verify.observe(bb, t, base * (1 + rng.uniform(0, 0.08) * (t - bb)) * rng.uniform(0.9, 1.1))
                draft.observe(bb, t, base * rng.uniform(0.02, 0.5))
        cands = []
        for _ in range(b):
            kind = rng.choice(["ngram", "draft", "medusa", "none"])
            n = 0 if kind == "none" else rng.randint(1, 10)
            gains = sorted((rng.random() ** rng.uniform(0.5, 3) for _ in range(n)), reverse=True)
            cands.append(Candidate(gains=gains, draft_rounds=kind == "draft", overhead_s=rng.uniform(0, 2e-3),
                                   first_feed=rng.randint(1, 2)))
        kw = dict(batch=b, base_tokens=b, draft_cost=draft, fixed_s=rng.uniform(0, 3e-3),
                  margin=rng.choice([0.0, 0.03, -1.0]), spec_scale=rng.uniform(0.5, 2.0))
        got = plan(cands, verify, **kw)
        # the reference: every prefix of the greedy order, priced in full
        total = sum(len(c.gains) for c in cands)
        curve = [verify.predict(b, b + e) for e in range(total + 1)]
        n_draft = sum(1 for c in cands if c.draft_rounds and c.gains)
        rounds = [0.0] + [draft.predict(n, n) for n in range(1, n_draft + 1)]
        plain = kw["fixed_s"] + curve[0]
        best_rate, best = b / plain * (1 + kw["margin"]), [0] * b
        heap = [(-c.gains[0], i) for i, c in enumerate(cands) if c.gains]
        heapq.heapify(heap)
        chosen = [0] * b
        while heap:
            _, i = heapq.heappop(heap)
            chosen[i] += 1
            rate = _rate(cands, chosen, curve, rounds, draft, b, kw["fixed_s"], kw["spec_scale"])
            if rate > best_rate * (1 + 1e-12):
                best_rate, best = rate, list(chosen)
            if chosen[i] < len(cands[i].gains):
                heapq.heappush(heap, (-cands[i].gains[chosen[i]], i))
        assert got == best, (trial, got, best)
