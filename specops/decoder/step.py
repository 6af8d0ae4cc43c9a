"""The speculative step of `Decoder.generate`, written once for every drafter.

A step is: propose → verify → accept → commit / roll back. The target side (verify,
accept, commit, roll back) is `speculation.TargetVerifier`; the drafter side is a
`Proposer`, so a method is only what it drafts from:

* `draft.DraftModelProposer` — a small draft model (its own KV cache, a C chain where the
  runner has one);
* `ngram.NgramProposer` — prompt lookup over the context, with the corpus store behind it;
* `eagle.EagleProposer` — the EAGLE feature drafter on the target's hidden states.

`run_steps` is the one loop of the linear methods (``draft``, ``ngram``, ``eagle``): each step
asks the schedule for γ, clamps it by the budget, the deadline and the drafter's own room,
lets the proposer draft, verifies through the verifier, lets the proposer catch up with what
was accepted, and feeds the schedule. ``auto`` runs the same proposers' steps through `step`
one at a time, choosing the proposer per step (`auto.generate_auto`). Medusa's tree step and
EAGLE's dynamic tree, whose proposals are trees rather than chains, keep their own loops
(`medusa_decode`, `eagle_tree.run_tree_steps`), on the same verifier rules (`tree_verify`)
and commit rule (`speculation.step_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from specops.decoder.clock import device_clock
from specops.decoder.schedule import GammaSchedule
from specops.decoder.speculation import DRAFT_CONTEXT, StepResult, TargetVerifier


class Proposer(Protocol):
    """The drafter side of a linear speculative step."""

    method: str
    """The method's name (``draft``, ``ngram``, ``eagle``), as `DecodeStats.method` reads."""
    device: torch.device
    """Where it drafts: its drafting time is read on this device's clock."""

    def start(self, v: TargetVerifier) -> None:
        """Take in the prompt, after the target's prefill (``v.features`` where it asked for them)."""

    def room(self, v: TargetVerifier) -> int | None:
        """The most tokens it can draft after ``v.tokens`` (0: it has run out of context, and
        the request goes on plainly); None: no bound of its own."""

    def propose(self, v: TargetVerifier, gamma: int, limit: int) -> tuple[list[int], Tensor | None]:
        """Draft for a step whose usual length is ``gamma``, never more than ``limit`` tokens
        (``limit`` >= 1); the drafted tokens and their q rows [1, G, V] (None: greedy or a
        deterministic drafter). Counts its forwards in ``v.stats``."""

    def sync(self, v: TargetVerifier, result: StepResult) -> float:
        """Catch up with the verified step (roll its cache back, read the accepted tokens); the
        seconds that took on its clock, counted as drafting time."""


@dataclass
class StepTimes:
    """What a `step` verified and what it cost."""

    drafted: int  # tokens verified (before any EOS cut)
    draft_s: float
    verify_s: float


def step(v: TargetVerifier, proposer: Proposer, gamma: int) -> tuple[StepResult, StepTimes]:
    """One speculative step of ``proposer`` with usual length ``gamma``: the verified result and
    what it drafted and cost. ``v.stats.draft_s`` includes the drafting seconds."""
    stats = v.stats
    limit = v.max_draft()
    room = proposer.room(v)
    if room is not None:
        if room == 0 and stats.fallback_reason is None:
            stats.fallback_reason = DRAFT_CONTEXT
        limit = min(limit, room)
    drafted: list[int] = []
    q: Tensor | None = None
    draft_s = 0.0
    if gamma > 0 and limit > 0:
        t0 = device_clock(proposer.device)
        drafted, q = proposer.propose(v, gamma, limit)
        draft_s = device_clock(proposer.device) - t0
        if len(drafted) > v.max_draft():  # the deadline passed while drafting: this step runs plainly
            drafted, q = [], None
    verify_before = stats.verify_s
    result = v.verify(drafted, q)
    draft_s += proposer.sync(v, result)
    stats.draft_s += draft_s
    return result, StepTimes(len(drafted), draft_s, stats.verify_s - verify_before)


def run_steps(v: TargetVerifier, proposer: Proposer, schedule: GammaSchedule) -> None:
    """Decode ``v``'s request to its end with ``proposer``: prefill, the proposer's start, then one
    `step` after another with γ from ``schedule``, which learns from every step that drafted."""
    v.prefill()
    proposer.start(v)
    while not v.done:
        v.stats.gamma = schedule.next_gamma()
        result, cost = step(v, proposer, v.stats.gamma)
        schedule.update(cost.drafted, result.raw_accepted, cost.draft_s, cost.verify_s)
