"""The one speculative step (`specops.spec.step`) with proposers written for the test: any
proposer's output is the target's own, the step clamps what it asks for, and it keeps the
proposer in step with what was verified."""

from __future__ import annotations

import random

import torch

from specops.spec.sampling import SamplingConfig, make_generator
from specops.spec.schedule import ConstantSchedule
from specops.spec.speculation import DRAFT_CONTEXT, StepResult, TargetVerifier
from specops.spec.stats import DecodeStats
from specops.spec.step import run_steps
from tests.decoder.scripted import TableRunner, chain_table

V = 16
GREEDY = SamplingConfig()


class ListProposer:
    """Drafts from a script: each step the next tokens of ``guess(tokens)``; records its calls."""

    method = "test"
    device = torch.device("cpu")

    def __init__(self, guess, room: int | None = None) -> None:
        self.guess = guess
        self._room = room
        self.calls: list[tuple[str, int, int]] = []  # (what, gamma or emitted, limit or tokens seen)
        self.seen: list[int] = []

    def start(self, v: TargetVerifier) -> None:
        self.seen = list(v.tokens)

    def room(self, v: TargetVerifier) -> int | None:
        return None if self._room is None else max(0, self._room - len(v.tokens))

    def propose(self, v: TargetVerifier, gamma: int, limit: int):
        assert limit >= 1 and gamma >= 1
        self.calls.append(("propose", gamma, limit))
        return self.guess(v.tokens)[: min(gamma, limit)], None

    def sync(self, v: TargetVerifier, result: StepResult) -> float:
        self.seen.extend(result.emitted)
        assert self.seen == v.tokens  # it has read every verified step, in order
        self.calls.append(("sync", len(result.emitted), len(v.tokens)))
        return 0.0


def decode(proposer, prompt, max_new, gamma=4, runner=None, deadline_s=None):
    runner = runner or TableRunner(chain_table(V))
    stats = DecodeStats(method=proposer.method)
    stats.start()
    v = TargetVerifier(runner, prompt, sampling=GREEDY, generator=make_generator(0), max_new_tokens=max_new,
                       eos_token_id=None, stats=stats, deadline_s=deadline_s)
    run_steps(v, proposer, ConstantSchedule(gamma))
    stats.finish(v.stop_reason())
    return v.output, stats


def test_any_proposal_gives_the_targets_greedy_output():
    rng = random.Random(3)
    truth = [(2 + i) % V for i in range(1, 31)]  # the chain table's continuation of [.., 2]
    for trial in range(20):
        def guess(tokens, trial=trial):
            nxt = (tokens[-1] + 1) % V
            right = [(nxt + k) % V for k in range(8)]
            # a random prefix of the truth, then noise
            cut = rng.randrange(0, 9)
            return right[:cut] + [rng.randrange(V) for _ in range(8 - cut)]
        out, stats = decode(ListProposer(guess), [0, 1, 2], 30)
        assert out == truth
        assert stats.new_tokens == 30


def test_a_right_proposal_is_accepted_whole_and_a_wrong_one_costs_a_plain_step():
    right = ListProposer(lambda toks: [(toks[-1] + 1 + k) % V for k in range(8)])
    out, stats = decode(right, [0], 20, gamma=4)
    assert stats.target_forwards == 4 and stats.accepted == stats.drafted == 16  # 5 tokens a forward
    wrong = ListProposer(lambda toks: [toks[-1]] * 8)  # never the successor
    out2, stats2 = decode(wrong, [0], 20, gamma=4)
    assert out2 == out and stats2.target_forwards == 20 and stats2.accepted == 0


def test_the_step_clamps_the_proposal_by_budget_and_room_and_reports_the_drafters_context():
    p = ListProposer(lambda toks: [(toks[-1] + 1 + k) % V for k in range(8)], room=9)
    out, stats = decode(p, [0, 1, 2], 12, gamma=6)
    assert out == [(3 + i) % V for i in range(12)]
    proposals = [c for c in p.calls if c[0] == "propose"]
    # room 9 - 3 tokens = 6 at the first step, then the drafter's context has run out
    assert proposals[0] == ("propose", 6, 6)
    assert len(proposals) == 1
    assert stats.fallback_reason == DRAFT_CONTEXT
    # every step, drafted or plain, was read by the proposer
    assert sum(1 for c in p.calls if c[0] == "sync") == stats.target_forwards - 1  # all but the prefill


def test_the_budgets_last_token_is_a_plain_step():
    p = ListProposer(lambda toks: [(toks[-1] + 1 + k) % V for k in range(8)])
    out, stats = decode(p, [0], 5, gamma=4)
    limits = [c[2] for c in p.calls if c[0] == "propose"]
    assert out == [1, 2, 3, 4, 5] and limits == [4]  # remaining - 1: the block ends exactly at the budget


def test_a_deadline_passed_while_drafting_runs_the_step_plainly():
    class Slow(ListProposer):
        def propose(self, v, gamma, limit):
            v.deadline = 0.0  # the deadline passes while it drafts
            return super().propose(v, gamma, limit)

    p = Slow(lambda toks: [(toks[-1] + 1 + k) % V for k in range(8)])
    out, stats = decode(p, [0], 10, gamma=4, deadline_s=60.0)
    assert out == list(range(1, 11))
    assert stats.fallback_reason == "deadline"
    assert stats.accepted == 0 and stats.target_forwards == 10  # the drafted block was dropped, then plain
    assert len([c for c in p.calls if c[0] == "propose"]) == 1
