"""Medusa decoding: heads propose a tree, one target forward verifies all of it.

One step (Cai et al. 2024, arXiv 2401.10774, with SpecInfer-style lossless sampling):

1. The *root* is the token the target chose last (not yet in the KV cache); the
   target's hidden state at the node before it feeds the K heads, whose top-k
   tokens fill the tree's nodes (`specops.spec.tree`).
2. The flattened tree ``[root, candidates...]`` goes through ONE target forward on
   top of the cached prefix, with the tree attention mask (each node sees the prefix,
   its ancestors and itself) and position ids ``prefix_len + depth``.
3. `specops.spec.tree_verify` walks the tree: the longest path the target agrees
   with (greedy), or recursive rejection sampling over siblings (exact sampling), and
   one recovered/bonus token after it, which becomes the next root.
4. ``runner.compact(prefix_len, path)`` keeps only the accepted path's KV entries.

The heads are a proposer of the one speculative step (`MedusaProposer`, run by
`step.run_steps`; the target side is `speculation.TargetVerifier.verify_tree`). Greedy steps on
the fast runner with C-kernel heads run steps 1–4 and the next step's heads as one C call
(`MedusaProposer.one_call`: `FastLlamaRunner.medusa_loop`, `c_step`): the same tokens and cache.
Greedy steps, in one call or not, also take a *prompt-lookup branch* (`medusa_branch`): when
the context's last three tokens occurred before (`ngram.NgramIndex`, full-length matches
only), ``lookup_branch`` tokens that followed them (more after a match that runs back
further: `medusa_branch.branch_length`) join the tree, merged into it as into a trie, so one forward
verifies the heads' guesses and the repetition and the walk keeps the longer accepted path.
Code and quoted text repeat themselves further than heads three deep can see.

Each step therefore emits ``accepted + 1`` tokens for one target forward. The tree
is the same at every step (chosen once per request, from the heads' measured
accuracy and the runner's measured verify cost when no tree is given), cut down near
the end of the token budget or the context window.

Stats: ``drafted`` counts tree *depth* positions speculated per step (like γ for a
linear draft; the branch's length when that is deeper), ``accepted`` the accepted path length after the root; per-head
accuracy compares each head's top-1 guess with the token that was finally emitted at
its position.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from specops.spec.errors import InvalidRequestError
from specops.models.runner import ModelRunner, prompt_forward
from specops.spec.sampling import SamplingConfig, next_token
from specops.spec.clock import device_clock
from specops.models.medusa_heads import HeadsLike, head_candidates
from specops.spec.medusa_branch import LOOKUP_BRANCH, branch_room, branch_tokens, context_index, merge_branch
from specops.spec.ngram import NgramIndex
from specops.spec.request import check_deadline, check_room, eos_set, prompt_list, stop_reason
from specops.spec.speculation import StepResult, TargetVerifier
from specops.spec.step import DraftTree, StepTimes, run_steps
from specops.spec.stats import DecodeStats
from specops.spec.tree import TreeBuffers, TreeError, TreeSpec, build_buffers, resolve_tree
from specops.spec.tree_size import TreePlanner, plan_tree, tree_planner
from specops.spec.tree_verify import (
    TreeVerification,
    TypicalAcceptance,
    judge_tree,
)
from specops.kernels import cpu_linear

logger = logging.getLogger(__name__)



class MedusaState:
    """Sequence, runner and tree of one Medusa request."""

    def __init__(self, target: ModelRunner, heads: HeadsLike, spec: TreeSpec, num_heads: int) -> None:
        self.target = target
        self.heads = heads
        self.num_heads = num_heads
        self.spec = spec
        self.head_guesses: list[tuple[int, int, int]] = []  # (output index, head 0-based, top-1 token)

    def buffers(self, spec: TreeSpec) -> TreeBuffers:
        return tree_buffers(spec, str(self.target.device))

    def propose(self, hidden: Tensor, spec: TreeSpec, root: int, root_index: int) -> tuple[Tensor, TreeBuffers]:
        """Tree tokens [N] from the heads' top-k at ``hidden`` [E]; logs each used head's top-1 guess
        (`propose_trees` for a batch of one)."""
        tokens, buffers, guesses = propose_trees(self.heads, hidden[None], [spec], [root], self.target.device)[0]
        self.head_guesses.extend((root_index + 1 + k, k, tok) for k, tok in enumerate(guesses))
        return tokens, buffers

    def head_accuracy(self, output: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per head: guesses whose position was emitted, and how many were right."""
        return head_accuracy(self.head_guesses, output, self.num_heads)


@functools.lru_cache(maxsize=128)
def tree_buffers(spec: TreeSpec, device: str) -> TreeBuffers:
    """Buffers are immutable once built, so requests share them per (topology, device)."""
    return build_buffers(spec, device)


def propose_trees(heads: HeadsLike, hidden: Tensor, specs: Sequence[TreeSpec], roots: Sequence[int],
                  device: torch.device | str) -> list[tuple[Tensor, TreeBuffers, list[int]]]:
    """One Medusa proposal over a batch (``Decoder.generate``'s batch of one, or an engine step).

    ``hidden`` [B, E]: each sequence's hidden state at the node before its root; ``roots``:
    the token each tree starts from (the last one chosen, not yet cached). The heads run
    once for the batch, only as deep as the deepest tree (not at all when every tree is
    root-only). Per sequence: its tree tokens [N] (root first, then each node's rank-th
    token of its head), the tree's buffers, and the top-1 guess of each head it used."""
    dev = str(device)
    buffers = [tree_buffers(spec, dev) for spec in specs]
    depth = max(spec.depth for spec in specs)
    top_all = None
    if depth:  # [D][B][k] as ints: a tree is a few dozen tokens, picked in Python and made one tensor
        top_all = head_candidates(heads, hidden, depth, max(b.top_k for b in buffers),
                                  torch.tensor(list(roots), dtype=torch.long)).tolist()
    out = []
    for i, (spec, buf, root) in enumerate(zip(specs, buffers, roots)):
        tokens, guesses = [root], []
        if spec.depth:
            top = [top_all[d][i][: buf.top_k] for d in range(spec.depth)]  # [D_i][top_k]
            flat = [tok for row in top for tok in row]
            tokens += [flat[j] for j in buf.candidate_index.tolist()]
            guesses = [row[0] for row in top]
        out.append((torch.tensor(tokens, dtype=torch.long, device=device), buf, guesses))  # [N]
    return out


def head_accuracy(guesses: Sequence[tuple[int, int, int]], output: Sequence[int],
                  num_heads: int) -> tuple[list[int], list[int]]:
    """Per head: of its top-1 ``guesses`` (output index, head, token) whose position was
    emitted, how many there were and how many were right."""
    predictions, correct = [0] * num_heads, [0] * num_heads
    for index, k, tok in guesses:
        if index < len(output):
            predictions[k] += 1
            correct[k] += int(output[index] == tok)
    return predictions, correct


def generate_medusa(
    target: ModelRunner,
    prompt_ids: Tensor,  # [B, T] long, B == 1
    *,
    heads: HeadsLike,
    sampling: SamplingConfig,
    generator: torch.Generator,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    num_heads: int | None = None,
    tree: str | TreeSpec | Sequence[Sequence[int]] | None = None,
    typical: bool | TypicalAcceptance | None = None,
    deadline_s: float | None = None,
    lookup_branch: int = LOOKUP_BRANCH,
) -> tuple[list[int], DecodeStats]:
    """Decode up to ``max_new_tokens`` tokens with Medusa tree speculation.

    ``num_heads``: heads to use (<= the heads' K; default all). ``tree``: a preset name,
    an explicit list of rank paths, a `TreeSpec`, None / "auto" for `plan_tree` (sized
    from the runner's measured verify cost), or an int n: that planned tree with at
    most n nodes, root included (a policy's ``tree_size`` bound; the plan may be smaller).
    ``typical``: LOSSY typical acceptance instead of exact rejection sampling (only with
    temperature > 0). ``deadline_s``: past it every step verifies the root alone, i.e. plain decoding on the same cache
    (``stats.fallback_reason == "deadline"``). ``lookup_branch``: greedy steps add, when the
    context's last `ngram.NgramIndex` ``max_ngram`` tokens occurred before, this many tokens
    that followed them as one more branch of the step's tree, two or three times as many after
    a match that runs back 8 or 16 tokens (`medusa_branch.branch_length`; merged into the tree as into a trie:
    the same forward verifies both, the walk keeps the longer accepted path); 0: the heads'
    tree alone. Exact either way.
    """
    if isinstance(lookup_branch, bool) or not isinstance(lookup_branch, int) or lookup_branch < 0:
        raise InvalidRequestError(f"lookup_branch must be an integer >= 0, got {lookup_branch!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if deadline_s is not None:
        check_deadline(deadline_s)  # a bad deadline is refused before any tree is planned
    prompt = prompt_list(prompt_ids)
    k = heads.num_heads if num_heads is None else num_heads
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= heads.num_heads:
        raise InvalidRequestError(f"heads must be in 1..{heads.num_heads} (the Medusa heads loaded), got {num_heads!r}")
    if isinstance(tree, int) and not isinstance(tree, bool) and tree < 1:
        raise InvalidRequestError(f"a tree size bound must be >= 1 node, got {tree}")
    planner: TreePlanner | None = None  # a planned tree: each step's size from live step times
    try:
        if isinstance(tree, int) and not isinstance(tree, bool):
            planner = tree_planner(target, heads, k, max_nodes=tree)
            spec = planner.best() if planner is not None else plan_tree(target, heads, k, max_nodes=tree)
        elif tree is None or tree == "auto":
            planner = tree_planner(target, heads, k)
            spec = planner.best() if planner is not None else plan_tree(target, heads, k)
        else:
            spec = resolve_tree(tree, k)
    except TreeError as exc:
        raise InvalidRequestError(str(exc)) from None
    if typical is True:
        typical = TypicalAcceptance()
    elif typical is False:
        typical = None
    if typical is not None and sampling.greedy:
        raise InvalidRequestError("typical acceptance applies to sampling (temperature > 0); greedy is exact already")
    state = MedusaState(target, heads, spec, k)
    stats = DecodeStats(method="medusa", heads=k)
    stats.start()
    v = TargetVerifier(target, prompt, sampling=sampling, generator=generator, max_new_tokens=max_new_tokens,
                       eos_token_id=eos_token_id, stats=stats, deadline_s=deadline_s, keep_hidden=True, typical=typical)
    # greedy on the fast runner: every step in one C call (`FastLlamaRunner.medusa_loop`), same tokens
    steps = c_steps(target, heads, k, spec, planner, lookup_branch) if sampling.greedy and typical is None else None
    run_steps(v, MedusaProposer(state, sampling, planner=planner, lookup_branch=lookup_branch, steps=steps), None)
    stats.head_predictions, stats.head_correct = state.head_accuracy(v.output)
    stats.finish(v.stop_reason())
    return v.output, stats


class MedusaProposer:
    """The Medusa heads as a `step.Proposer`: each step's tree from the heads at the target's
    hidden state before the pending token (the verifier keeps it: ``keep_hidden``), with the
    prompt-lookup branch merged in for greedy requests (`medusa_branch`), verified in one tree
    forward (`TargetVerifier.verify_tree`). Where the fast runner has the heads' C step loop
    (``steps``, `c_steps`: greedy), a whole step runs in one call instead (`one_call`). With a
    ``planner`` each step's tree size comes from live step times (`tree_size.TreePlanner`), else
    the state's tree. ``index``: an n-gram index over the sequence kept by someone else (`auto`'s
    n-gram proposer), else the proposer keeps its own."""

    method = "medusa"

    def __init__(self, state: MedusaState, sampling: SamplingConfig, *, planner: TreePlanner | None = None,
                 lookup_branch: int = LOOKUP_BRANCH, steps=None, index: NgramIndex | None = None) -> None:
        self.state = state
        self.planner = planner
        self.steps = steps
        self.branch = lookup_branch if sampling.greedy else 0  # sampled trees take no branch
        self.device = state.target.device
        self.index = index
        self._own_index = index is None
        self.fresh = False  # the C step loop holds the candidates of the current hidden state and pending token
        self._ran = False  # the last step was this proposer's one-call step
        self.caught_up = 0.0  # seconds of the last one-call step's extra proposal (after a step of another kind)
        self._timing: tuple[TreeSpec, TreeSpec, bool, float] | None = None  # planned, used, branch?, start

    def start(self, v: TargetVerifier) -> None:
        if self.branch and self._own_index:
            self.index = context_index(v.tokens)

    def room(self, v: TargetVerifier) -> None:
        return None  # its tree is cut to the budget and the context each step

    def _spec(self, v: TargetVerifier, limit: int) -> tuple[TreeSpec, TreeSpec, int]:
        """The planned tree, the tree this step uses (cut to ``limit`` drafts and the context), the context's room."""
        spec = self.planner.next_spec() if self.planner is not None else self.state.spec
        space = v.target.max_context - v.target.cache_len
        if spec.depth > limit or spec.num_nodes > space:
            return spec, spec.limit(max_depth=limit, max_nodes=space), space
        return spec, spec, space

    def propose(self, v: TargetVerifier, gamma: int, limit: int) -> DraftTree | None:
        self.caught_up = 0.0
        if not v.has_hidden:  # a one-token prompt: the first step runs plainly
            return None
        t0 = device_clock(self.device)
        spec, step_spec, space = self._spec(v, limit)
        tokens, buffers = self.state.propose(v.hidden, step_spec, v.tokens[-1], len(v.output) - 1)  # [N]
        branch = None
        if self.branch:
            specs = self.planner.specs.values() if self.planner is not None else [self.state.spec]
            branch = branch_tokens(self.index, self.branch, limit,
                                   min(space, branch_room(specs, self.branch)) - step_spec.num_nodes)
            tokens, buffers = merge_branch(tokens, buffers, branch)
        self._timing = (spec, step_spec, bool(branch), t0)
        return DraftTree(tokens, buffers, drafted=max(step_spec.depth, len(branch) if branch else 0))

    def one_call(self, v: TargetVerifier, limit: int) -> tuple[StepResult, StepTimes] | None:
        steps = self.steps
        if steps is None or not v.has_hidden:
            return None
        stats = v.stats
        t0 = device_clock(self.device)
        spec, step_spec, space = self._spec(v, limit)
        if not self.fresh:
            c_propose(steps, self.state, v.hidden, v.tokens[-1])
        branch = c_branch(self.index, steps, step_spec, self.branch, limit, space) if self.branch else None
        t1 = device_clock(self.device)
        accepted, next_tok, heads_s, drafted = c_step(steps, self.state, step_spec, v.tokens[-1], len(v.output),
                                                      branch)
        v.hidden_from(steps.last_hidden)  # [E], read only if the next step needs it (not after another C step)
        result = v.commit(accepted, next_tok, drafted=drafted)
        t2 = device_clock(self.device)
        draft_s, verify_s = t1 - t0 + heads_s, t2 - t1 - heads_s
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.target_forwards += 1
        self.caught_up = t1 - t0
        self._ran = True
        if self.planner is not None and step_spec.num_nodes == spec.num_nodes and not branch:
            self.planner.observe(spec.num_nodes, t2 - t0)  # a clean timing of the tree
        return result, StepTimes(drafted, draft_s, verify_s)

    def sync(self, v: TargetVerifier, result: StepResult) -> float:
        """Read the verified step, whoever proposed it: the branch index takes its tokens, the
        planner a clean timing of its own tree step; the C loop's candidates stay current only
        after its own one-call step."""
        self.fresh, self._ran = self._ran, False
        timing, self._timing = self._timing, None
        if timing is not None and self.planner is not None:
            spec, step_spec, branch, t0 = timing
            if step_spec.num_nodes == spec.num_nodes and not branch:
                self.planner.observe(spec.num_nodes, device_clock(self.device) - t0)  # a clean timing of the tree
        if self._own_index and self.index is not None:
            self.index.extend(result.emitted)
        return 0.0


def c_steps(target: ModelRunner, heads: HeadsLike, k: int, spec: TreeSpec, planner: TreePlanner | None,
            branch: int = 0):
    """The runner's one-call greedy steps (`FastLlamaRunner.medusa_loop`) for every tree this
    request may use, with room for a long match's branch (`medusa_branch.branch_room`: BRANCH_MAX_SCALE x ``branch`` more
    nodes) where the C layer stack allows, or None where the runner or the heads lack them
    (then each step proposes and verifies from Python)."""
    make, weights_for = getattr(target, "medusa_loop", None), getattr(heads, "kernel_weights", None)
    if make is None or weights_for is None:
        return None
    specs = list(planner.specs.values()) if planner is not None else [spec]
    top_k = max(1, max(tree_buffers(s, "cpu").top_k for s in specs))
    weights = weights_for(k, top_k)
    if weights is None:
        return None
    return make(weights, k, top_k, branch_room(specs, branch))


@functools.lru_cache(maxsize=256)
def c_tree(spec: TreeSpec, top_k: int) -> Tensor:
    """``spec`` as `cpu_linear.StepLoop.medusa_step` reads it, with ``top_k`` candidates kept per head."""
    buf = tree_buffers(spec, "cpu")
    src = [0] + [(c // buf.top_k) * top_k + c % buf.top_k for c in buf.candidate_index.tolist()]
    return cpu_linear.medusa_tree_words(src, buf.depth.tolist(), buf.parent.tolist(), buf.attn_mask)


def c_propose(steps, state: MedusaState, hidden: Tensor, root: int) -> None:
    """Set ``steps``' candidates from the heads at ``hidden`` [E] with ``root`` (what a one-call
    step leaves for the next one; needed before the first, and after a step of another kind)."""
    cands = head_candidates(state.heads, hidden[None], state.num_heads, steps.top_k,
                            torch.tensor([root], dtype=torch.long))  # [K, 1, TK]
    steps.cands.copy_(cands.reshape(-1))


def c_branch(index: NgramIndex | None, steps, spec: TreeSpec, most: int, drafts: int, space: int) -> list[int] | None:
    """The prompt-lookup branch of a one-call step over ``spec`` (`medusa_branch.branch_tokens`):
    at most ``drafts`` (what the budget lets a step draft) and what the context's ``space``
    positions and the step loop's nodes leave beside the tree."""
    return branch_tokens(index, most, drafts, min(space, steps.max_nodes) - spec.num_nodes)


def c_step(steps, state: MedusaState, spec: TreeSpec, root: int, at: int,
           branch: list[int] | None = None) -> tuple[list[int], int, float, int]:
    """One greedy step over ``spec`` rooted at ``root`` in one C call (`MedusaSteps.step`), with
    ``branch`` (tokens drafted after the root, `c_branch`) merged into the tree, its heads' top-1
    guesses logged for output positions ``at`` on. Returns the accepted tokens, the next token,
    the heads' seconds (the next step's proposal, made in the same call) and the positions it
    drafted (the tree's depth, or the branch's length when that is deeper)."""
    tk = steps.top_k
    if spec.depth:
        top1 = steps.cands.tolist()
        state.head_guesses.extend((at + d, d, top1[d * tk]) for d in range(spec.depth))
    result, heads_s = steps.step(c_tree(spec, tk), root, branch)
    return result[2 : 1 + result[0]], result[1], heads_s, max(spec.depth, len(branch) if branch else 0)
