"""Tree planning of the serving engine: what tree-shaped speculation offers the plan, and its calibration.

`TreePlans` builds the planner's `Candidate` of a Medusa tree (the heads' nodes, and for a greedy
request its prompt-lookup branch beside them: `BranchOffer`, `specops.spec.medusa_branch`) and
of a greedy eagle request's EAGLE-2 tree (the drafter's calibrated estimates of its best nodes),
settles what a chosen plan proposes (the Medusa tree and branch, the EAGLE-2 tree's levels), and
calibrates the estimates on every verified tree: the kind's and the sequence's accepted tokens per
estimated token, the branches' acceptance. It holds this step's offers per request and counts the
Medusa steps whose tree carried a branch and the tokens accepted on it (`EngineStats`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from specops.spec.medusa_branch import LOOKUP_BRANCH, branch_accepted, branch_tokens
from specops.engine.acceptance import ALPHA_RECOVERY, EAGLE_TREE, SEQ_DECAY, SEQ_PRIOR_TRIALS, AcceptancePriors
from specops.engine.sequence import DEFAULT_TREE_SIZE, Sequence
from specops.engine.spec_planner import Candidate, isotonic

BRANCH_KIND = "medusa_branch"  # the acceptance kind of Medusa's prompt-lookup branches (`AcceptancePriors`)


@dataclass
class BranchOffer:
    """A greedy Medusa sequence's prompt-lookup branch this step, as its `Candidate` offers it."""

    tokens: list[int]  # the branch (`medusa_branch.branch_tokens`)
    heads: list[float]  # the heads' nodes' expected acceptance, best first (the tree's gains alone)
    branch: list[float]  # each branch token's expected acceptance beyond the heads' tree
    mix: list[bool]  # the candidate's gains in order: True where the gain is the branch's next token

    def gains(self) -> list[float]:
        """The candidate's gains: the heads' nodes and the branch's tokens in ``mix`` order."""
        heads, branch = iter(self.heads), iter(self.branch)
        return [next(branch) if take else next(heads) for take in self.mix]

    def split(self, extra: int) -> tuple[int, list[int]]:
        """The heads' nodes and the branch tokens of a plan that takes ``extra`` of the gains."""
        branch = sum(self.mix[:extra])
        return extra - branch, self.tokens[:branch]


class TreePlans:
    """The engine's Medusa and EAGLE-2 tree offers, their settled proposals and their calibration.

    ``priors``: the engine's `AcceptancePriors`; ``medusa``: its `MedusaProposer` (None without
    heads); ``max_model_len``: the context a tree's nodes fit in; ``note_lookup(request_id,
    seconds)``: where a branch's prompt lookup is timed (the step's proposal time)."""

    def __init__(self, priors: AcceptancePriors, medusa: Any, max_model_len: int,
                 note_lookup: Callable[[str, float], None]) -> None:
        self.priors = priors
        self.medusa = medusa
        self.max_model_len = max_model_len
        self.note_lookup = note_lookup
        self.branches: dict[str, BranchOffer] = {}  # this step's Medusa prompt-lookup branches, per request
        self.tree_depth: dict[str, int] = {}  # this step's EAGLE-2 tree levels, per request
        self.medusa_branches = 0  # greedy Medusa steps whose tree carried a prompt-lookup branch
        self.medusa_branch_tokens = 0  # tokens they accepted on the branch's own nodes

    def start_plan(self) -> None:
        """Forget the previous step's offers."""
        self.branches, self.tree_depth = {}, {}

    # -- EAGLE-2 trees --------------------------------------------------------------
    @staticmethod
    def tree_key(seq: Sequence) -> tuple:
        """The acceptance kind of an EAGLE-2 tree sequence: its class's greedy trees of its depth and width."""
        shape = seq.eagle.shape
        return (*seq.prior_key, EAGLE_TREE, shape.depth, shape.topk)

    def tree_candidate(self, seq: Sequence, bound: int, overhead: float) -> Candidate:
        """A greedy eagle sequence's EAGLE-2 tree offer: ``bound`` (budget, target and drafter context)
        cuts its levels, the context its nodes. The k-th node's gain is what the drafter estimated of
        the k-th best node of the kind's recent trees (`AcceptancePriors.profile`) times what such
        trees really accepted per estimated token (``accept_scale``: the sequence's own, shrunk toward
        the kind's `AcceptancePriors.tree_scale`); before the kind drafted a tree, its first ``depth``
        nodes are offered at what a chain's tokens would gain. The plan takes a prefix of them (the
        tree's best nodes, as `eagle_tree.keep_best` keeps them) or none, and charges the trees' own
        measured drafting overhead, not the chains'. A tree cut shallower than the kind's (near the budget's end) is
        offered no more nodes than its levels draft, at the kind's estimates."""
        shape = seq.eagle.shape
        depth = min(shape.depth, bound)
        room = max(0, self.max_model_len - len(seq.tokens))
        nodes = min(shape.tree_size - 1, shape.topk + (depth - 1) * shape.topk * shape.topk, room) if depth else 0
        profile = self.priors.profile(self.tree_key(seq))
        if profile is None:
            gains = self.priors.gains(seq.prior_key, "eagle", seq.alpha, depth)
        else:
            gains = [min(g * seq.accept_scale, 1.0) for g in profile]
        self.tree_depth[seq.request_id] = depth
        return Candidate(gains=gains[:nodes], overhead_s=overhead)

    def observe_tree(self, seq: Sequence, accepted: int, p: dict) -> None:
        """Calibrate the drafter's estimates on a verified EAGLE-2 tree: its kind's profile (a tree
        drafted to its shape's depth), the kind's and the sequence's accepted per estimated token."""
        key, expected = self.tree_key(seq), p["expected"]
        if p["full"]:
            self.priors.observe_profile(key, p["estimates"])
        self.priors.observe_tree(key, accepted, expected)
        state = seq.eagle
        state.hits = SEQ_DECAY * state.hits + accepted
        state.expected = SEQ_DECAY * state.expected + expected
        self.update_tree_scale(seq)

    def update_tree_scale(self, seq: Sequence) -> None:
        """An EAGLE-2 tree sequence's own accepted per estimated token, shrunk toward its kind's
        (`SEQ_PRIOR_TRIALS` estimated tokens' worth), as a linear draft's α is."""
        state = seq.eagle
        kind = self.priors.tree_scale(self.tree_key(seq))
        seq.accept_scale = (state.hits + SEQ_PRIOR_TRIALS * kind) / (state.expected + SEQ_PRIOR_TRIALS)

    def recover_tree(self, seq: Sequence) -> None:
        """An EAGLE-2 tree sequence that did not speculate this step drifts back toward its kind's
        scale (`ALPHA_RECOVERY`), so it is probed again later."""
        seq.eagle.hits *= 1.0 - ALPHA_RECOVERY
        seq.eagle.expected *= 1.0 - ALPHA_RECOVERY
        self.update_tree_scale(seq)

    # -- Medusa trees and their prompt-lookup branches -----------------------------------
    def lookup_branch(self, seq: Sequence) -> int:
        """The usual length of ``seq``'s prompt-lookup branch (`SpecSettings.lookup_branch`)."""
        return LOOKUP_BRANCH if seq.spec.lookup_branch is None else seq.spec.lookup_branch

    @staticmethod
    def branch_key(seq: Sequence) -> tuple:
        """The acceptance kind of ``seq``'s branches: its class's (greedy) branches."""
        return (seq.spec.auto_key, BRANCH_KIND, False)

    def medusa_candidate(self, seq: Sequence, bound: int, overhead: float) -> Candidate:
        """A Medusa sequence's tree offer: the heads' nodes (at most ``bound`` deep, as many as the
        context holds), scaled by the request's own acceptance so far, and for a greedy request with
        a prompt-lookup index its branch beside them (`branch_offer`, kept for `settle`)."""
        max_nodes = seq.spec.tree_size or DEFAULT_TREE_SIZE
        room = max(0, self.max_model_len - len(seq.tokens))
        gains = self.medusa.gains(seq.heads, max_nodes, max_depth=bound)[:room]
        gains = [min(g * seq.accept_scale, 1.0) for g in gains]  # this request's own acceptance so far
        if seq.ngram is not None:  # a greedy request with a prompt-lookup branch
            offer = self.branch_offer(seq, gains, bound, min(room, max_nodes - 1), max_nodes)
            if offer is not None:
                self.branches[seq.request_id] = offer
                gains = offer.gains()
        return Candidate(gains=gains, overhead_s=overhead, max_nodes=max_nodes)

    def branch_offer(self, seq: Sequence, heads: list[float], bound: int, limit: int,
                     max_nodes: int) -> BranchOffer | None:
        """The prompt-lookup branch a greedy Medusa sequence offers this step beside the heads' nodes
        (``heads``: their gains, best first), or None without one. The branch is at most ``bound``
        tokens (the step's drafts: budget and context) and, with the heads' nodes, ``limit`` gains
        (the tree's node bound). Its k-th token is expected to be accepted as the branches of the
        request's class were at depth k (`AcceptancePriors`, n-gram's prior before any), and to add
        a token where the heads' tree would not reach depth k (taken as independent: at most one
        node per depth is accepted, the walk keeps the longer path). Deep tokens, past the heads,
        can add more than shallow ones: the branch's gains are pooled into a non-increasing list
        (`isotonic`, what a plan taking a prefix of them expects in all), and the branch and the
        heads' nodes are offered in one list, best first."""
        t0 = time.perf_counter()
        branch = branch_tokens(seq.ngram, self.lookup_branch(seq), bound, limit)
        spent = time.perf_counter() - t0  # a lookup: ~10 us, the cheap wall clock (see the engine's n-gram candidate)
        self.note_lookup(seq.request_id, spent)
        if branch is None:
            return None
        key = self.branch_key(seq)
        hit = self.priors.gains(key, "ngram", self.priors.alpha(key, "ngram"), len(branch))
        reach = [0.0] * (len(branch) + 1)  # P(the heads' tree accepts a node at depth d)
        for (path, _), g in zip(self.medusa.ranked(seq.heads, max_nodes), heads):
            if len(path) <= len(branch):
                reach[len(path)] += g
        marginal = [-g for g in isotonic([-p * max(0.0, 1.0 - reach[d]) for d, p in enumerate(hit, start=1)])]
        mix: list[bool] = []
        i = j = 0
        while len(mix) < limit and (i < len(heads) or j < len(marginal)):
            take = j < len(marginal) and (i == len(heads) or marginal[j] > heads[i])
            mix.append(take)
            j, i = (j + 1, i) if take else (j, i + 1)
        return BranchOffer(tokens=branch, heads=heads, branch=marginal, mix=mix)

    # -- the plan's trees ------------------------------------------------------------
    def settle(self, seq: Sequence, c: Candidate, extra: int) -> dict:
        """What a plan of ``extra`` tokens fixes before ``seq``'s proposer runs: an EAGLE-2 tree's
        levels (`tree_candidate`), a Medusa tree's spec, the heads' expected acceptance of it and
        its branch tokens (`BranchOffer.split`); nothing for a linear draft."""
        if seq.request_id in self.tree_depth:  # an EAGLE-2 tree: its levels
            return {"depth": self.tree_depth[seq.request_id]}
        if seq.spec.method != "medusa":
            return {}
        offer = self.branches.get(seq.request_id)
        nodes, branch = offer.split(extra) if offer is not None else (extra, [])
        heads = offer.heads if offer is not None else c.gains
        return {"tree": self.medusa.spec(seq.heads, c.max_nodes, nodes + 1),
                "expected": sum(heads[:nodes]) / max(seq.accept_scale, 1e-3), "branch": branch}

    def observe(self, seq: Sequence, p: dict, emitted: list[int], accepted: int, heads_accepted: int) -> None:
        """Calibrate on a verified tree that accepted ``accepted`` nodes (``heads_accepted`` of them
        the heads' tree's own) and emitted ``emitted`` (its bonus token last): an EAGLE-2 tree's
        drafter estimates (`observe_tree`), a Medusa tree's accuracy table scale (what the table
        expected of it vs what came), and its branch's acceptance and counts."""
        if seq.eagle is not None:  # an EAGLE-2 tree: what its drafter expected of it vs what came
            self.observe_tree(seq, accepted, p)
        elif p.get("expected"):  # what the accuracy table expected of this tree vs what came
            seq.accept_scale = 0.8 * seq.accept_scale + 0.2 * heads_accepted / p["expected"]
            self.priors.observe_scale(seq.prior_key, heads_accepted / p["expected"])
        branch = p.get("branch") or []
        if branch:
            hit = branch_accepted(branch, emitted[:-1])
            self.priors.observe_alpha(self.branch_key(seq), hit, hit + (1 if hit < len(branch) else 0))
            self.medusa_branches += 1
            self.medusa_branch_tokens += accepted - heads_accepted
