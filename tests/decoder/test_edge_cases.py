"""Speculation edge cases, forced exactly with table-driven runners, and per-step stats.

`TableRunner` models make the target's and the draft's choices known in advance, so
each test sets up one situation (everything accepted, rejection at the last position,
EOS inside an accepted block, max_new_tokens or the context landing mid-block) and
checks the output, the stats and every cache operation the loop performed.
"""

from __future__ import annotations

import pytest
import torch

from specops.spec.autoregressive import generate_ar
from specops.spec.draft import generate_draft
from specops.spec.ngram import generate_ngram
from specops.spec.sampling import SamplingConfig, make_generator
from specops.spec.schedule import ConstantSchedule, make_schedule
from tests.decoder.scripted import TableRunner, chain_table

V = 16
GREEDY = SamplingConfig()


def run_draft(target, draft, prompt, gamma=4, max_new=10, eos=None, sampling=GREEDY, schedule=None):
    return generate_draft(
        target, draft, torch.tensor([prompt]), sampling=sampling, generator=make_generator(0),
        max_new_tokens=max_new, eos_token_id=eos, schedule=schedule or ConstantSchedule(gamma),
    )


def forwards(runner):
    return [c for c in runner.calls if c[0] == "forward"]


def test_everything_accepted_uses_bonus_tokens_and_refeeds_the_last_draft_token():
    target, draft = TableRunner(chain_table(V)), TableRunner(chain_table(V))
    tokens, stats = run_draft(target, draft, [0], gamma=4, max_new=10)
    assert tokens == list(range(1, 11))
    assert stats.steps == 2 and stats.gamma_trace == [4, 4]
    assert stats.accepted == stats.drafted == 8
    assert stats.accepted_per_pos == [2, 2, 2, 2]
    assert stats.target_forwards == 2  # a 1-token prompt needs no prefill
    # target: [pending + 4 drafts] twice, never rolled back, never recomputing the prefix
    assert forwards(target) == [("forward", 0, 5), ("forward", 5, 5)]
    # draft: after a full acceptance it feeds [d_G, bonus] (2 tokens) in its first forward
    assert forwards(draft)[4] == ("forward", 4, 2)
    assert stats.draft_forwards == 8


def test_rejection_at_the_last_position_rolls_back_one_target_entry():
    target = TableRunner(chain_table(V))
    draft = TableRunner(chain_table(V, {3: 9}))  # the draft's 4th guess is wrong
    tokens, stats = run_draft(target, draft, [0], gamma=4, max_new=5)
    assert tokens == [1, 2, 3, 4, 5]
    assert stats.gamma_trace[0] == 4 and stats.accepted_per_pos[:4] == [1, 1, 1, 0]
    # target ran [0, 1, 2, 3, 9] then dropped the entry of 9: cache [0, 1, 2, 3], pending 4
    assert ("truncate", 5, 4) in target.calls
    # the draft never fed 9, so its cache [0, 1, 2, 3] was already right
    assert draft.calls.count(("truncate", 4, 4)) <= 1 and all(c[2] >= 4 for c in draft.calls if c[0] == "truncate")
    assert forwards(target)[1] == ("forward", 4, 1)  # budget left 1: a plain step from pending token 4


def test_rejection_at_the_first_position_emits_the_recovered_token():
    target = TableRunner(chain_table(V))
    draft = TableRunner(chain_table(V, {0: 7}))
    tokens, stats = run_draft(target, draft, [0], gamma=3, max_new=5)
    assert tokens == [1, 2, 3, 4, 5]
    assert stats.gamma_trace[0] == 3 and stats.drafted_per_pos[0] == stats.steps
    assert ("truncate", 4, 1) in target.calls  # [0, 7, 8, 9] -> [0]; 1 becomes pending
    assert ("truncate", 3, 1) in draft.calls  # the draft fed [0, 7, 8] -> [0]


def test_eos_inside_an_accepted_block_stops_there():
    target, draft = TableRunner(chain_table(V)), TableRunner(chain_table(V))
    tokens, stats = run_draft(target, draft, [0], gamma=4, max_new=10, eos=2)
    assert tokens == [1, 2]
    assert stats.stop_reason == "eos"
    # the drafted tokens after EOS count neither as drafted nor as accepted
    assert stats.drafted == stats.accepted == 2 and stats.accepted_per_pos == [1, 1]
    assert stats.new_tokens == 2 and len(stats.token_latencies_s) == 2


def test_eos_as_the_bonus_token_stops_after_it():
    target, draft = TableRunner(chain_table(V)), TableRunner(chain_table(V))
    tokens, stats = run_draft(target, draft, [0], gamma=3, max_new=10, eos=[4, 15])
    assert tokens == [1, 2, 3, 4]
    assert stats.drafted == 3 and stats.accepted == 3 and stats.stop_reason == "eos"


@pytest.mark.parametrize("max_new, trace", [(1, [0]), (3, [2]), (6, [4, 0]), (7, [4, 1])])
def test_max_new_tokens_landing_mid_block_is_exact(max_new, trace):
    target, draft = TableRunner(chain_table(V)), TableRunner(chain_table(V))
    tokens, stats = run_draft(target, draft, [0], gamma=4, max_new=max_new)
    assert tokens == list(range(1, max_new + 1))
    assert stats.gamma_trace == trace  # γ clamped to remaining - 1, so no token is wasted
    assert stats.gamma == 4  # the schedule's choice, reported to telemetry
    assert stats.stop_reason == "max_new_tokens"


def test_context_window_filling_up_stops_generation():
    target = TableRunner(chain_table(V), max_context=8)
    draft = TableRunner(chain_table(V), max_context=8)
    tokens, stats = run_draft(target, draft, [0, 1, 2, 3, 4], gamma=4, max_new=10)
    assert tokens == [5, 6, 7]
    assert stats.stop_reason == "context"
    tokens, stats = generate_ar(target, torch.tensor([[0, 1, 2, 3, 4]]), sampling=GREEDY,
                                generator=make_generator(0), max_new_tokens=10)
    assert tokens == [5, 6, 7] and stats.stop_reason == "context"


def test_a_draft_with_a_smaller_context_stops_drafting_and_the_target_decodes_on():
    target = TableRunner(chain_table(V), max_context=64)
    draft = TableRunner(chain_table(V), max_context=8)
    tokens, stats = run_draft(target, draft, [0, 1, 2], gamma=4, max_new=20)
    assert tokens == [t % V for t in range(3, 23)] and stats.stop_reason == "max_new_tokens"
    assert stats.fallback_reason == "draft_context" and 0 < stats.drafted <= 8 - 3 + 1
    tokens, stats = run_draft(target, draft, list(range(10)), gamma=4, max_new=2)  # longer than the draft
    assert tokens == [10, 11] and stats.drafted == 0 and stats.fallback_reason == "draft_context"


def test_prefix_is_never_recomputed():
    target = TableRunner(chain_table(V))
    draft = TableRunner(chain_table(V, {2: 11, 7: 0}))
    prompt = [5, 6, 7, 8, 0]
    tokens, stats = run_draft(target, draft, prompt, gamma=3, max_new=12)
    assert tokens == [(1 + i) % V for i in range(12)]
    # every target forward starts exactly at the current cache end (no rewinding beyond
    # rejected entries) and the work is the prefill plus G + 1 positions per step
    fw = forwards(target)
    assert fw[0] == ("forward", 0, len(prompt) - 1)
    assert sum(t for _, _, t in fw) == len(prompt) - 1 + sum(g + 1 for g in stats.gamma_trace)


def test_ngram_drafts_from_the_context_and_stays_exact():
    target = TableRunner(chain_table(V, {5: 0}))  # 0 1 2 3 4 5 0 1 2 ... repeats
    prompt = [0, 1, 2, 3, 4, 5, 0]
    tokens, stats = generate_ngram(target, torch.tensor([prompt]), sampling=GREEDY, generator=make_generator(0),
                                   max_new_tokens=12, schedule=ConstantSchedule(4))
    assert tokens == [1, 2, 3, 4, 5, 0] * 2
    assert stats.accepted == stats.drafted > 0  # the lookup predicts a periodic text perfectly
    assert stats.target_forwards < 12


def check_invariants(stats, tokens, prompt_len, has_draft_model):
    assert stats.new_tokens == len(tokens) == len(stats.token_latencies_s)
    assert sum(stats.accepted_per_pos) == stats.accepted <= stats.drafted == sum(stats.drafted_per_pos)
    assert len(stats.accepted_per_pos) == len(stats.drafted_per_pos)
    for i, (a, d) in enumerate(zip(stats.accepted_per_pos, stats.drafted_per_pos)):
        assert a <= d
        if i:
            assert a <= stats.accepted_per_pos[i - 1] and d <= stats.drafted_per_pos[i - 1]
    assert len(stats.gamma_trace) == stats.steps
    assert stats.drafted == sum(stats.gamma_trace) or stats.stop_reason == "eos"
    assert stats.target_forwards == stats.steps + (1 if prompt_len > 1 else 0)
    if has_draft_model:
        assert stats.draft_forwards == sum(stats.gamma_trace) + (1 if prompt_len > 1 else 0)
    if stats.stop_reason != "eos":
        assert stats.new_tokens == stats.accepted + stats.steps  # each step: accepted + 1 tokens
    assert stats.wall_s > 0 and stats.tokens_per_s > 0 and stats.verify_s > 0


@pytest.mark.parametrize("schedule", ["constant", "heuristic", "goodput"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_per_step_stats_are_consistent_on_real_models(schedule, temperature):
    from tests.decoder.tiny_models import perturbed, tiny_llama

    target_model = tiny_llama(seed=21)
    from specops.models.loading import load_runner

    target = load_runner(target_model, impl="fast")
    draft = load_runner(perturbed(target_model, noise=0.3, seed=22), impl="fast")
    sampling = SamplingConfig(temperature=temperature)
    gen = torch.Generator().manual_seed(1)
    for i in range(12):
        prompt = torch.randint(0, 96, (1, 1 + 3 * i), generator=gen)
        eos = 7 if i % 3 == 0 else None
        tokens, stats = generate_draft(target, draft, prompt, sampling=sampling, generator=make_generator(i),
                                       max_new_tokens=20, eos_token_id=eos, schedule=make_schedule(schedule, 3, 1, 6))
        check_invariants(stats, tokens, prompt.shape[1], has_draft_model=True)
        assert all(0 <= g <= 6 for g in stats.gamma_trace)
        tokens, stats = generate_ngram(target, prompt, sampling=sampling, generator=make_generator(i),
                                       max_new_tokens=20, eos_token_id=eos, schedule=make_schedule(schedule, 3, 1, 6))
        check_invariants(stats, tokens, prompt.shape[1], has_draft_model=False)
        tokens, stats = generate_ar(target, prompt, sampling=sampling, generator=make_generator(i),
                                    max_new_tokens=20, eos_token_id=eos)
        assert stats.target_forwards == stats.new_tokens == len(tokens) and stats.drafted == 0
        assert stats.plain_token_s is None or stats.plain_token_s > 0
