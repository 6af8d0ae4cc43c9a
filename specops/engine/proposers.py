"""The drafter side of one engine step: every method behind one interface, `GroupProposer`.

The engine plans each sequence's speculation, groups the sequences by method and asks that
method's proposer for the whole group at once (`NgramGroup`, `DraftGroup`, `EagleGroup`,
`MedusaGroup`); each answers a `Proposed` per sequence: the block or tree to verify and what
it cost. The drafting rules themselves are the library's (`NgramIndex.step_drafts`,
`draft.draft_rounds`, `eagle.draft_chain`, `eagle_tree.draft_tree`, `medusa_decode.propose_trees`), so a method
proposes the same tokens in `Decoder.generate` and in the engine. N-gram proposals need no model (each sequence's
`specops.spec.ngram.NgramIndex`, asked when the plan weighs them). The model-based ones:

* `draft_blocks`: the draft model drafts γ_i tokens for every sequence i in
  max(γ_i) batched rounds. Round 0 feeds each sequence what the draft cache lacks (its
  pending token, ``[d_G, bonus]`` after a fully accepted block, or the whole sequence
  after admission or preemption); later rounds feed one token each, and a sequence
  leaves the batch once it has its γ_i tokens (ragged speculation), by the rounds'
  rule `specops.spec.draft.draft_rounds` (the library's draft model drafts by it too). Its
  distributions q are filtered exactly like the target's (`specops.spec.sampling`). When every
  drafting sequence is greedy or samples from softmax(logits / T) alone (no top-k / top-p)
  and the draft model runs the paged C stack (fp32 CPU), all rounds run in one C call
  (`PagedBackend.draft_chain`; greedy: the same tokens and cache as the loop; sampled: draws
  from the same q with one uniform per token from the request's generator):
  the per-round Python work (the items, the batch arrays, the argmax, ~1 ms a round at
  batch 1) cost several times the bundled 1-layer draft's forward.
* `EagleGroup`: each sequence's EAGLE chain, or a greedy request's EAGLE-2 dynamic tree
  (`specops.spec.eagle_tree.draft_tree`), on its own drafter cache (`specops.engine.eagle_proposer`).
* `MedusaProposer`: the heads read every sequence's hidden state in one call and each
  sequence gets its own tree (the best ``n_i`` nodes of the sparse tree built from the
  heads' measured accuracy, `specops.spec.tree.ranked_nodes`), a greedy sequence's
  prompt-lookup branch merged into it (`specops.spec.medusa_branch`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

import torch
from torch import Tensor

from specops.spec.draft import chain_draws, chain_uniforms, draft_rounds
from specops.spec.medusa_branch import merge_branch
from specops.spec.medusa_decode import propose_trees
from specops.spec.tree import TreeBuffers, TreeSpec, make_spec, preset, ranked_nodes
from specops.engine.batch_forward import FeedItem
from specops.engine.sequence import Sequence

# the clocks `draft_blocks` can time a C drafting chain's rounds with (clock_gettime ids, as Python's own)
CLOCK_IDS: dict[Callable[[], float], int] = {
    clock: getattr(time, name) for clock, name in ((time.perf_counter, "CLOCK_MONOTONIC"),
                                                  (time.process_time, "CLOCK_PROCESS_CPUTIME_ID"),
                                                  (time.thread_time, "CLOCK_THREAD_CPUTIME_ID"))
    if hasattr(time, name)}

PRIOR_DEPTH_ACCEPT = 0.6  # per-depth acceptance guess for heads without a measured accuracy table


def draft_blocks(backend, seqs: list[Sequence], gammas: list[int],
                 observe: Callable[[int, int, float], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> list[tuple[list[int], Tensor | None]]:
    """Per sequence: γ_i drafted tokens and their q rows [γ_i, V] (None when greedy), by the
    library's drafting rule (`specops.spec.draft.draft_rounds`) over the batched draft forward.

    ``observe(B, T, seconds)`` is called after each drafting round, timed by ``clock`` (the
    planner's cost) over the batched draft forward AND the round's own host work: the argmax,
    each sampled sequence's probabilities and draw, the next round's items. That work grows
    with the tokens drafted, like the forwards; timed as a per-sequence overhead instead it was
    missed by the plan (at batch 4 a draft round's host work was as long as its forward, and
    the planner chose drafts whose real step cost ~25% more than it predicted)."""
    items = {i: FeedItem(kv=seq.draft, tokens=seq.tokens[seq.draft.computed :],
                         rows=[len(seq.tokens) - seq.draft.computed - 1])
             for i, seq in enumerate(seqs) if gammas[i] > 0}
    chain = getattr(backend, "draft_chain", None)
    clock_id = CLOCK_IDS.get(clock)
    if chain is not None and items and clock_id is not None and all(
            chain_draws(seqs[i].sampling, seqs[i].generator) for i in items):
        active = list(items)
        want = [gammas[i] for i in active]
        inv_temps, uniforms = None, None
        if not all(seqs[i].sampling.greedy for i in active):
            # one float64 uniform per drafted token from the request's own generator, as the
            # single-request chain (`specops.spec.draft`) takes them; q = softmax(logits / T). Where
            # the chain then declines (a catch-up above its token limit), the rounds below draw afresh:
            # the unused uniforms are independent of everything, so the output distribution is the same
            # and a seeded request still repeats itself
            inv_temps = [0.0 if seqs[i].sampling.greedy else 1.0 / seqs[i].sampling.temperature for i in active]
            uniforms = np.zeros((len(active), max(want)), dtype=np.float64)
            for j, i in enumerate(active):
                if not seqs[i].sampling.greedy:
                    uniforms[j, : want[j]] = chain_uniforms(want[j], seqs[i].generator).numpy()
        done = chain(list(items.values()), want, clock_id, inv_temps=inv_temps, uniforms=uniforms)  # every round in one C call
        if done is not None:
            tokens, rounds, q = done
            if observe is not None:  # each round as the rounds below report it: (sequences, tokens fed, seconds)
                fed0 = sum(len(it.tokens) for it in items.values())
                for r, seconds in enumerate(rounds):
                    b = sum(1 for g in want if g > r)
                    observe(b, fed0 if r == 0 else b, seconds)
            out: list[tuple[list[int], Tensor | None]] = [([], None) for _ in seqs]
            for j, (i, toks) in enumerate(zip(active, tokens)):
                out[i] = (toks, None if seqs[i].sampling.greedy else q[j, : want[j]])
            return out
    t0, width, fed_tokens = 0.0, 0, 0  # the round under way: its start, sequences and tokens fed

    def forward(active: list[int], fed: list[int] | None) -> list[Tensor]:
        nonlocal t0, width, fed_tokens
        t0 = clock()  # a round: its items, the forward, then its draws (`after_round`)
        feed = ([items[i] for i in active] if fed is None else
                [FeedItem(kv=seqs[i].draft, tokens=[tok], rows=[0]) for i, tok in zip(active, fed)])
        width, fed_tokens = len(feed), sum(len(it.tokens) for it in feed)
        return [out.logits for out in backend.forward(feed)]  # [1, V] each

    def after_round() -> None:
        if observe is not None:
            observe(width, fed_tokens, clock() - t0)

    return draft_rounds(forward, gammas, [s.sampling for s in seqs], [s.generator for s in seqs], after_round)


class MedusaProposer:
    """Medusa heads plus the ranked tree nodes per number of heads."""

    def __init__(self, heads, device: torch.device) -> None:
        self.heads = heads
        self.device = device
        self.accuracy = getattr(getattr(heads, "config", None), "head_topk_accuracy", None) or None
        self._ranked: dict[tuple[int, int], list[tuple[tuple[int, ...], float]]] = {}

    def ranked(self, num_heads: int, max_nodes: int) -> list[tuple[tuple[int, ...], float]]:
        """Best-first non-root nodes with their estimated acceptance (up to max_nodes - 1)."""
        key = (num_heads, max_nodes)
        if key not in self._ranked:
            if self.accuracy:
                nodes = ranked_nodes(self.accuracy[:num_heads], max_nodes)
            else:
                spec = preset("large", num_heads)
                scored = [(p, PRIOR_DEPTH_ACCEPT ** len(p) / (1 + sum(p))) for p in spec.paths]
                nodes = sorted(scored, key=lambda x: (-x[1], len(x[0]), x[0]))[: max_nodes - 1]
            self._ranked[key] = nodes
        return self._ranked[key]

    def gains(self, num_heads: int, max_nodes: int, max_depth: int) -> list[float]:
        """Marginal expected accepted tokens of the 2nd..n-th node (prefix-closed order)."""
        out = []
        for path, p in self.ranked(num_heads, max_nodes):
            if len(path) > max_depth:
                break  # keep prefix-closed: stop at the first node too deep
            out.append(p)
        return out

    def spec(self, num_heads: int, max_nodes: int, nodes: int) -> TreeSpec:
        paths = [p for p, _ in self.ranked(num_heads, max_nodes)[: nodes - 1]]
        return make_spec(paths, name=f"sparse{nodes}")

    def propose(self, seqs: list[Sequence], specs: list[TreeSpec],
                branches: list[list[int]] | None = None) -> list[tuple[Tensor, TreeBuffers]]:
        """Per sequence: tree tokens [N] (root = pending token first) and the tree's buffers
        (`specops.spec.medusa_decode.propose_trees`, which ``Decoder.generate`` runs too), with
        its prompt-lookup branch (``branches``, tokens after the root; empty: none) merged in
        (`specops.spec.medusa_branch.merge_branch`, as the library's greedy steps merge it)."""
        hidden = torch.stack([s.hidden for s in seqs]) if any(s.depth for s in specs) else None  # [B, E]
        out = []
        for i, (seq, (tokens, buffers, guesses)) in enumerate(zip(seqs, propose_trees(
                self.heads, hidden, specs, [s.tokens[-1] for s in seqs], self.device))):
            base = seq.num_output  # head k guesses output index base + k (the root is output base - 1)
            seq.head_guesses.extend((base + k, k, t) for k, t in enumerate(guesses))
            out.append(merge_branch(tokens, buffers, branches[i]) if branches else (tokens, buffers))
        return out


# -- the engine step's drafter side, one interface for every method -------------------------------

@dataclass
class Proposed:
    """One sequence's proposal for a step and what making it cost."""

    plan: dict[str, Any]
    """What the step feeds and verifies: ``drafts`` and ``q`` (a linear block), or ``tree_tokens``
    and ``buffers`` (a tree)."""
    draft_s: float = 0.0
    """Wall seconds counted in the request's ``draft_s``."""
    share_s: float = 0.0
    """Cost-clock seconds of the proposal charged to this sequence (the planner's per-sequence
    speculation overhead, `StepAccounts.measure_overheads`)."""
    forwards: int = 0
    """Drafter forwards counted in the request's ``draft_forwards``."""


class GroupProposer(Protocol):
    """The drafter side of the engine's step for one method: the proposals of every sequence of
    the batch that runs it, made in one call (a batched draft model runs all of them together).
    ``sizes[i]``: tokens (a block's γ, a tree's extra nodes) the plan granted sequence i;
    ``plans[i]``: what the plan settled for it (a Medusa tree's spec and branch)."""

    def propose(self, seqs: list[Sequence], sizes: list[int], plans: list[dict[str, Any]]) -> list[Proposed]:
        ...


class NgramGroup:
    """Prompt lookup: the proposal was made when the plan weighed it (`Engine._candidate`, through
    `NgramIndex.step_drafts`) and comes in ``plans[i]["drafts"]``; the step drafts the granted part."""

    def propose(self, seqs: list[Sequence], sizes: list[int], plans: list[dict[str, Any]]) -> list[Proposed]:
        return [Proposed({"drafts": plan["drafts"][:size], "q": None}) for plan, size in zip(plans, sizes)]


class DraftGroup:
    """A draft model: every sequence's block in batched rounds (`draft_blocks`). ``observe``: each
    round's (sequences, tokens fed, seconds) for the planner's draft cost; ``note_catch_up``: the
    engine's account of a long catch-up (`Engine._note_catch_up`)."""

    def __init__(self, backend, clock: Callable[[], float], observe: Callable[[list[float]], Callable],
                 note_catch_up: Callable[..., None]) -> None:
        self.backend = backend
        self.clock = clock
        self.observe = observe
        self.note_catch_up = note_catch_up

    def propose(self, seqs: list[Sequence], sizes: list[int], plans: list[dict[str, Any]]) -> list[Proposed]:
        t0, c0 = time.perf_counter(), self.clock()
        before = [s.draft.computed for s in seqs]
        forwards: list[float] = []
        blocks = draft_blocks(self.backend, seqs, sizes, observe=self.observe(forwards), clock=self.clock)
        dt = time.perf_counter() - t0
        spent = self.clock() - c0
        host = max(spent - sum(forwards), 0.0) / len(seqs)  # outside the rounds (their set-up)
        self.note_catch_up(seqs, before, forwards, dt, spent)
        fed = sum(s.draft.computed - b for s, b in zip(seqs, before))
        return [Proposed({"drafts": drafted, "q": q}, draft_s=dt * (seq.draft.computed - b) / max(fed, 1),
                         share_s=host, forwards=len(drafted))
                for seq, b, (drafted, q) in zip(seqs, before, blocks)]


class EagleGroup:
    """The EAGLE drafter (`specops.engine.eagle_proposer.EagleProposer`): each sequence runs its own
    chain, or its own EAGLE-2 tree (a greedy request that asks for one: ``plans[i]["depth"]``, the
    tree's levels; ``sizes[i]``, its nodes past the root), on its own drafter cache, timed one by one.
    A tree's plan carries the drafter's ``estimates`` of its shape's best nodes, best first (the
    tree's own first: ``expected`` is their sum) and whether it was drafted to the shape's full
    depth (``full``: only such estimates describe the shape)."""

    def __init__(self, eagle, clock: Callable[[], float]) -> None:
        self.eagle = eagle
        self.clock = clock

    def propose(self, seqs: list[Sequence], sizes: list[int], plans: list[dict[str, Any]]) -> list[Proposed]:
        out = []
        for seq, size, plan in zip(seqs, sizes, plans):
            t0, c0 = time.perf_counter(), self.clock()
            if "depth" in plan:
                tree, estimates, forwards, full = self.eagle.propose_tree(seq, plan["depth"], size + 1)
                made = {"tree_tokens": tree.tokens, "buffers": tree.buffers, "estimates": estimates,
                        "expected": sum(estimates[: tree.buffers.num_nodes - 1]), "full": full}
            else:
                drafted, q = self.eagle.propose(seq, size)
                made, forwards = {"drafts": drafted, "q": q}, size  # the feed of the real entries, then γ - 1 steps
            dt = time.perf_counter() - t0
            out.append(Proposed(made, draft_s=dt, share_s=self.clock() - c0, forwards=forwards))
        return out


class MedusaGroup:
    """Medusa heads: every sequence's tree from one heads call (`MedusaProposer.propose`), with its
    prompt-lookup branch merged in."""

    def __init__(self, medusa: MedusaProposer, clock: Callable[[], float]) -> None:
        self.medusa = medusa
        self.clock = clock

    def propose(self, seqs: list[Sequence], sizes: list[int], plans: list[dict[str, Any]]) -> list[Proposed]:
        t0, c0 = time.perf_counter(), self.clock()
        trees = self.medusa.propose(seqs, [p["tree"] for p in plans], [p["branch"] for p in plans])
        dt = time.perf_counter() - t0
        spent = self.clock() - c0
        return [Proposed({"tree_tokens": tokens, "buffers": buffers}, draft_s=dt / len(seqs),
                         share_s=spent / len(seqs)) for tokens, buffers in trees]
