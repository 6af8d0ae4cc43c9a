"""Scheduler (admission, preemption of the newest, lookahead grants) and the load-aware planner."""

from __future__ import annotations

import torch

from specops.spec.sampling import SamplingConfig
from specops.spec.stats import DecodeStats
from specops.engine.kv_pool import BlockPool
from specops.engine.scheduler import Scheduler
from specops.engine.sequence import SamplingParams, Sequence, SeqStatus, SpecSettings
from specops.engine.spec_planner import Candidate, CostModel, linear_gains, plan


def make_seq(rid: str, n: int) -> Sequence:
    return Sequence(request_id=rid, tokens=list(range(n)), prompt_len=n, params=SamplingParams(max_tokens=100),
                    spec=SpecSettings(), sampling=SamplingConfig(), generator=torch.Generator(), arrival=0.0,
                    budget=100, stats=DecodeStats(method="ar"))


def released(pool):
    def release(seq):
        pool.release(seq.target.blocks)
        seq.target.computed = 0
    return release


def test_admission_respects_batch_cap_and_memory():
    pool = BlockPool(8, 4)
    sch = Scheduler(pool, max_batch=2, max_step_tokens=1000, release=released(pool))
    for i in range(3):
        sch.add(make_seq(f"s{i}", 6))  # 2 blocks each
    batch = sch.schedule()
    assert [s.request_id for s in batch] == ["s0", "s1"]  # cap 2
    assert pool.num_used == 4 and len(sch.waiting) == 1


def test_running_first_and_the_newest_is_preempted_when_blocks_run_out():
    pool = BlockPool(5, 4)
    sch = Scheduler(pool, max_batch=4, max_step_tokens=1000, release=released(pool))
    a, b = make_seq("a", 7), make_seq("b", 7)  # 2 blocks each (+1 spare for a when b is admitted)
    sch.add(a)
    sch.schedule()
    sch.add(b)
    assert [s.request_id for s in sch.schedule()] == ["a", "b"]
    a.tokens.extend([0] * 6)  # a now needs 4 blocks: b (newest) is preempted
    batch = sch.schedule()
    assert [s.request_id for s in batch] == ["a"]
    assert b.status is SeqStatus.WAITING and b.target.blocks == [] and sch.waiting[0] is b
    assert sch.preemptions == 1 and pool.num_used == 4


def test_admission_keeps_a_spare_block_per_running_sequence():
    pool = BlockPool(4, 4)
    sch = Scheduler(pool, max_batch=4, max_step_tokens=1000, release=released(pool))
    sch.add(make_seq("a", 7))
    sch.schedule()
    sch.add(make_seq("b", 7))  # 2 free blocks, but a keeps one spare: b waits (no thrashing)
    assert [s.request_id for s in sch.schedule()] == ["a"] and len(sch.waiting) == 1


def test_grant_is_all_or_nothing():
    pool = BlockPool(3, 4)
    sch = Scheduler(pool, max_batch=4, max_step_tokens=1000, release=released(pool))
    s = make_seq("s", 4)
    sch.add(s)
    sch.schedule()
    assert pool.num_used == 1
    assert not sch.grant(s, 9)  # 13 slots = 4 blocks > 3
    assert pool.num_used == 1
    assert sch.grant(s, 8) and pool.num_used == 3


def test_planner_speculates_at_low_load_and_switches_off_at_high_load():
    cost = CostModel()
    # a forward costs 10 ms plus 0.05 ms per token at batch 1 ... but 2 ms per extra token at batch 16
    for b, per_token in ((1, 0.05e-3), (16, 2e-3)):
        for t in range(b, b * 6 + 1):
            cost.observe(b, t, 10e-3 + per_token * (t - b))
    low = plan([Candidate(gains=linear_gains(0.8, 5))], cost, batch=1, base_tokens=1)
    assert low == [5]
    high = plan([Candidate(gains=linear_gains(0.8, 5)) for _ in range(16)], cost, batch=16, base_tokens=16)
    assert sum(high) < 16  # shrinks...
    worst = plan([Candidate(gains=linear_gains(0.2, 5)) for _ in range(16)], cost, batch=16, base_tokens=16)
    assert worst == [0] * 16  # ...and switches off when acceptance is low
    mixed = plan([Candidate(gains=linear_gains(0.95, 4)), Candidate(gains=linear_gains(0.1, 4))], cost,
                 batch=2, base_tokens=2)
    assert mixed[0] >= mixed[1]  # each sequence its own gamma: the better acceptor drafts more


def test_cost_model_fit_predicts_unseen_points():
    cost = CostModel()
    for b in (1, 4, 16):
        for t in (b, 3 * b, 5 * b):
            cost.observe(b, t, 1e-3 + 1e-4 * t + 1e-5 * b)
    assert abs(cost.predict(4, 30) - (1e-3 + 30e-4 + 4e-5)) < 1e-9  # along one batch size's line
    assert abs(cost.predict(10, 20) - (1e-3 + 20e-4 + 10e-5)) < 1e-9  # between two batch sizes


def test_cost_model_never_predicts_cheaper_for_more_tokens_under_noise():
    cost = CostModel()
    for t, sec in ((1, 9e-3), (2, 4e-3), (3, 8e-3), (4, 3e-3)):  # noise: bigger looks cheaper
        cost.observe(1, t, sec)
    assert cost.predict(1, 8) >= cost.predict(1, 1)


def test_a_same_step_shared_prefix_defers_admission_once_and_keeps_fifo():
    pool = BlockPool(16, 4, prefix_caching=True)
    sch = Scheduler(pool, max_batch=4, max_step_tokens=1000, release=released(pool))
    a, b, c = make_seq("a", 10), make_seq("b", 10), make_seq("c", 10)
    c.tokens = [50 + t for t in c.tokens]  # shares nothing
    for s in (a, b, c):
        sch.add(s)
    assert [s.request_id for s in sch.schedule()] == ["a"]  # b would recompute a's 2 blocks
    assert sch.deferrals == 1 and [s.request_id for s in sch.waiting] == ["b", "c"] and b.target.blocks == []
    a.target.computed = 10  # a's prefill ran: its full blocks are published at its commit
    a.target.published = pool.publish(a.target.blocks, a.tokens, 10, 0)
    assert [s.request_id for s in sch.schedule()] == ["a", "b", "c"]
    assert b.target.computed == 8 and b.target.blocks[:2] == a.target.blocks[:2] and c.target.computed == 0
    assert sch.deferrals == 1


def test_without_prefix_caching_or_a_shared_block_nobody_waits():
    for caching, second in ((False, list(range(10))), (True, list(range(3)) + [99] * 7)):
        pool = BlockPool(16, 4, prefix_caching=caching)
        sch = Scheduler(pool, max_batch=4, max_step_tokens=1000, release=released(pool))
        a, b = make_seq("a", 10), make_seq("b", 10)
        b.tokens = second  # caching: b's first block differs from a's in its last token
        sch.add(a)
        sch.add(b)
        assert [s.request_id for s in sch.schedule()] == ["a", "b"] and sch.deferrals == 0
