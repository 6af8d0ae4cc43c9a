"""The speculative step of `Decoder.generate`, written once for every drafter.

A step is: propose → verify → accept → commit / roll back. The target side (verify,
accept, commit, roll back) is `speculation.TargetVerifier`; the drafter side is a
`Proposer`, so a method is only what it drafts from:

* `draft.DraftModelProposer` — a small draft model (its own KV cache, a C chain where the
  runner has one);
* `ngram.NgramProposer` — prompt lookup over the context, with the corpus store behind it;
* `eagle.EagleProposer` — the EAGLE feature drafter on the target's hidden states, and
  `eagle_tree.EagleTreeProposer`, its dynamic tree (EAGLE-2);
* `medusa_decode.MedusaProposer` — the Medusa heads' tree on the target's last hidden state,
  with the prompt-lookup branch merged into it.

A proposal is a chain (drafted tokens and their q rows: `TargetVerifier.verify`) or a
`DraftTree` (`TargetVerifier.verify_tree`). A proposer whose runner does a whole step in one
call (the fast runner's greedy Medusa step loop) offers it as ``one_call``; `step` takes it
where offered, so the fast path sits behind the same interface, on the same commit rule.

`run_steps` is the one loop of every method but ``auto``: each step asks the schedule for γ
(a tree's depth bound), clamps it by the budget, the deadline and the drafter's own room,
lets the proposer draft, verifies through the verifier, lets the proposer catch up with what
was accepted, and feeds the schedule. ``auto`` runs the same proposers' steps through `step`
one at a time, choosing the proposer per step (`auto.generate_auto`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

import torch
from torch import Tensor

from specops.spec.clock import device_clock
from specops.spec.schedule import GammaSchedule
from specops.spec.speculation import DRAFT_CONTEXT, StepResult, TargetVerifier
from specops.spec.tree import TreeBuffers


@dataclass
class DraftTree:
    """A drafted tree, verified in one target forward (`TargetVerifier.verify_tree`)."""

    tokens: Tensor  # [N] long: the root (the pending token), then the nodes in ``buffers``' order
    buffers: TreeBuffers
    drafted: int | None = None
    """Positions the step drafted (None: the tree's depth; a merged prompt-lookup branch may reach deeper)."""

    @property
    def depth(self) -> int:
        return self.buffers.spec.depth if self.drafted is None else self.drafted


Proposal = Union[tuple[list[int], "Tensor | None"], DraftTree, None]
"""What `Proposer.propose` returns: a chain (drafted tokens, q rows [1, G, V] or None), a tree,
or None (nothing to draft this step: it runs plainly)."""


class Proposer(Protocol):
    """The drafter side of a speculative step (a chain or a tree)."""

    method: str
    """The method's name (``draft``, ``ngram``, ``eagle``, ``medusa``), as `DecodeStats.method` reads."""
    device: torch.device
    """Where it drafts: its drafting time is read on this device's clock."""

    def start(self, v: TargetVerifier) -> None:
        """Take in the prompt, after the target's prefill (``v.features`` where it asked for them)."""

    def room(self, v: TargetVerifier) -> int | None:
        """The most tokens it can draft after ``v.tokens`` (0: it has run out of context, and
        the request goes on plainly); None: no bound of its own."""

    def propose(self, v: TargetVerifier, gamma: int, limit: int) -> Proposal:
        """Draft for a step whose usual length (a tree: depth) is ``gamma``, never more than
        ``limit`` positions deep (``limit`` >= 1): the drafted tokens and their q rows [1, G, V]
        (None: greedy or a deterministic drafter), a `DraftTree`, or None. Counts its forwards
        in ``v.stats``."""

    def sync(self, v: TargetVerifier, result: StepResult) -> float:
        """Catch up with the verified step (roll its cache back, read the accepted tokens); the
        seconds that took on its clock, counted as drafting time."""

    # Optional, where the runner does a whole step in one call (the fast runner's greedy Medusa loop):
    # one_call(v, limit) -> tuple[StepResult, StepTimes] | None runs one step of at most ``limit``
    # drafts and commits it through ``v.commit`` (counting its seconds and forward in ``v.stats``);
    # None where it cannot (the step then proposes and verifies as usual). `sync` reads the step
    # after it, as after any other.


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
    one_call = getattr(proposer, "one_call", None)
    if one_call is not None and gamma > 0 and limit > 0:
        done = one_call(v, min(gamma, limit))
        if done is not None:
            proposer.sync(v, done[0])
            return done
    proposal: Proposal = None
    draft_s = 0.0
    if gamma > 0 and limit > 0:
        t0 = device_clock(proposer.device)
        proposal = proposer.propose(v, gamma, limit)
        draft_s = device_clock(proposer.device) - t0
    verify_before = stats.verify_s
    if isinstance(proposal, DraftTree):
        drafted = proposal.depth
        if drafted > v.max_draft():  # the deadline passed while drafting: this step runs plainly
            drafted, result = 0, v.verify([])
        else:
            result = v.verify_tree(proposal.tokens, proposal.buffers, drafted=proposal.drafted)
    else:
        tokens, q = proposal if proposal is not None else ([], None)
        if len(tokens) > v.max_draft():  # the deadline passed while drafting: this step runs plainly
            tokens, q = [], None
        drafted = len(tokens)
        result = v.verify(tokens, q)
    draft_s += proposer.sync(v, result)
    stats.draft_s += draft_s
    return result, StepTimes(drafted, draft_s, stats.verify_s - verify_before)


def run_steps(v: TargetVerifier, proposer: Proposer, schedule: GammaSchedule | None) -> None:
    """Decode ``v``'s request to its end with ``proposer``: prefill, the proposer's start, then one
    `step` after another with γ from ``schedule``, which learns from every step that drafted; None:
    no γ of its own (a Medusa tree is sized by its planner and cut to the budget each step)."""
    v.prefill()
    proposer.start(v)
    while not v.done:
        if schedule is None:
            step(v, proposer, max(v.remaining - 1, 0))
            continue
        v.stats.gamma = schedule.next_gamma()
        result, cost = step(v, proposer, v.stats.gamma)
        schedule.update(cost.drafted, result.raw_accepted, cost.draft_s, cost.verify_s)
