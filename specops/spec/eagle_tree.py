"""EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858) for greedy ``eagle`` requests.

A chain (`eagle.draft_chain`) follows the drafter's top-1 token; a tree also keeps the
alternatives the drafter is unsure between, shaped every step by the drafter's own confidence.
A node's *value* is the product of the drafter's softmax probabilities along its path from the
root (here its logarithm, a sum), the drafter's estimate that the target accepts the path.

1. Expansion: the root is the pending token; its children are the drafter's ``topk`` tokens at
   its prediction of the pending token's feature. At each depth the ``topk`` nodes of that depth
   with the highest value run through the drafter in one forward: their entries share the
   depth's position and each sees the real entries and its own ancestors only (a tree mask over
   the drafter's cache); each gets its ``topk`` tokens as children. ``depth`` levels in all, so
   ``depth - 1`` drafter forwards.
2. Reranking: of every node drafted, the ``tree_size - 1`` of highest value (ties: the shallower,
   then the earlier drafted) join the root (`keep_best`). A node's value is at most its
   parent's, so the kept nodes form a tree; `keep_best` never keeps a node without its parent.
3. Verification: the kept tree goes through the target in one forward with its tree mask
   (`speculation.TargetVerifier.verify_tree`): the greedy walk (`tree_verify.judge_tree`) keeps
   the longest path of the target's argmaxes, the target's cache is compacted to it, and the
   target's hidden states along it are the features the drafter reads next.
4. Roll back: the drafter drops every drafted entry (`eagle.EagleCursor.tree` cuts its cache back
   to the real entries) and reads the accepted positions' real features (`EagleProposer.sync`),
   as after a chain.

Greedy output equals plain greedy decoding: the walk emits only the target's argmaxes. Sampled
requests (temperature > 0) keep the chain, whose rejection sampling against the drafter's q is
lossless (`generate_eagle`). Stats count a tree step as Medusa's: ``drafted`` = the kept tree's
depth, ``accepted`` = the accepted path's length after the root; ``draft_forwards`` one per
depth (the ``depth - 1`` expansions and the roll back's feed).

N tree nodes (root included) · K = ``topk`` · D = ``depth`` · F drafter vocabulary · E features.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specops.spec.eagle import EagleProposer
from specops.spec.errors import InvalidRequestError
from specops.spec.sampling import SamplingConfig
from specops.spec.speculation import TargetVerifier
from specops.spec.step import DraftTree
from specops.spec.tree import TreeBuffers, TreeSpec, build_buffers, make_spec

MAX_DEPTH = 32
MAX_TOPK = 32


@dataclass(frozen=True)
class EagleTree:
    """The shape of a dynamic draft tree (``generate(method="eagle", eagle_tree=(depth, topk, tree_size))``)."""

    depth: int
    """Levels drafted below the root: the most drafts one step can accept; ``depth - 1`` drafter forwards."""
    topk: int
    """Nodes expanded per level, and children drafted per expanded node."""
    tree_size: int
    """Nodes the target verifies in one forward, the root included (fewer near the budget's or context's end)."""

    def __post_init__(self) -> None:
        for name, low, high in (("depth", 1, MAX_DEPTH), ("topk", 1, MAX_TOPK), ("tree_size", 2, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                bound = f"in {low}..{high}" if high else f">= {low}"
                raise InvalidRequestError(f"eagle_tree {name} must be an integer {bound}, got {value!r}")
        if self.tree_size > 1 + self.drafted_nodes:
            raise InvalidRequestError(f"eagle_tree tree_size {self.tree_size} exceeds the {1 + self.drafted_nodes} "
                                      f"nodes (root included) a tree {self.depth} deep with topk {self.topk} drafts")

    @property
    def drafted_nodes(self) -> int:
        """Nodes drafted before reranking: K children of the root, K * K per level below."""
        return self.topk + (self.depth - 1) * self.topk * self.topk


def tree_shape(value: Any) -> EagleTree | None:
    """A request's ``eagle_tree`` option: None or False: the chain; an `EagleTree` or a
    (depth, topk, tree_size) triple of ints: that tree; anything else: `InvalidRequestError`."""
    if value is None or value is False:
        return None
    if isinstance(value, EagleTree):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 3:
        return EagleTree(*value)
    raise InvalidRequestError(f"eagle_tree must be (depth, topk, tree_size), e.g. (5, 4, 24), got {value!r}")


def keep_best(values: list[float], parents: list[int], depths: list[int], count: int) -> list[int]:
    """The indices of the ``count`` drafted nodes of highest value (ties: the shallower, then the
    lower index), best first, each after its parent (``parents``: a node's index, -1 for a child of
    the root). A node whose parent is not kept is never kept: the result is always a tree."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], depths[i], i))
    kept: list[int] = []
    chosen: set[int] = set()
    for i in order:
        if len(kept) == count:
            break
        if parents[i] < 0 or parents[i] in chosen:
            kept.append(i)
            chosen.add(i)
    return kept


@functools.lru_cache(maxsize=256)
def _buffers(spec: TreeSpec, device: str) -> TreeBuffers:
    """Buffers are immutable: steps whose trees take one shape share them."""
    return build_buffers(spec, device)


def draft_tree(drafter, last: Tensor, root: int, shape: EagleTree, depth: int, size: int,
               device: torch.device, cache=None, estimates: list[float] | None = None) -> tuple[DraftTree, int]:
    """Draft a tree after the pending token ``root`` from ``last`` [E], the drafter's prediction of
    its feature: ``depth`` (<= shape.depth) levels of ``shape.topk``, then the best ``size``
    (<= shape.tree_size) nodes, root included (see the module docstring). ``cache``: the
    sequence's drafter cache (None: the drafter's own), which holds the real entries and gains
    the expanded nodes' (cut them off after verification). ``estimates``: receives the drafter's
    estimate that the target accepts each of the best ``shape.tree_size - 1`` drafted nodes (the
    exponent of its value), best first: the kept nodes' first (the serving engine plans its
    trees on them). Returns the tree (its tensors on ``device``, the target's) and the drafter
    forwards run."""
    cache = drafter.cache if cache is None else cache
    real = cache.length  # entries 0 .. real - 1 read real features; depth-d nodes sit at position real + d - 1
    shortlist = drafter.shortlist
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    ranks: list[int] = []
    values: list[float] = []
    inputs: list[Tensor] = []  # [E] each: the feature a node's entry reads, its parent's prediction
    ancestry: dict[int, list[int]] = {}  # expanded node -> the cache slots of its ancestors and its own

    def add_children(nodes: list[int], logits: Tensor, feats: Tensor) -> None:  # logits [R, F], feats [R, E]
        """Each of ``nodes`` (-1: the root) gets its ``topk`` tokens under ``logits``' row as children."""
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), min(shape.topk, logits.shape[-1]), dim=-1)
        ids = top.indices if shortlist is None else shortlist.to(top.indices.device)[top.indices]  # [R, K]
        for row, (parent, vals, toks) in enumerate(zip(nodes, top.values.tolist(), ids.tolist())):
            base = values[parent] if parent >= 0 else 0.0
            for rank, (v, tok) in enumerate(zip(vals, toks)):
                tokens.append(tok)
                parents.append(parent)
                depths.append(1 if parent < 0 else depths[parent] + 1)
                ranks.append(rank)
                values.append(base + v)
                inputs.append(feats[row])

    add_children([-1], drafter.logits(last[None]), last[None])
    forwards = 0
    for d in range(1, depth):
        level = [i for i in range(len(tokens)) if depths[i] == d]
        frontier = sorted(level, key=lambda i: (-values[i], i))[: shape.topk]
        t, start = len(frontier), cache.length
        mask = torch.zeros(t, start + t, dtype=torch.bool)  # [K, L + K]
        mask[:, :real] = True
        for row, i in enumerate(frontier):
            ancestry[i] = (ancestry[parents[i]] if parents[i] >= 0 else []) + [start + row]
            mask[row, ancestry[i]] = True
        feats = drafter.step(torch.tensor([tokens[i] for i in frontier], device=last.device),
                             torch.stack([inputs[i] for i in frontier]), cache,
                             positions=torch.full((t,), real + d - 1, dtype=torch.long, device=last.device),
                             mask=mask)  # [K, E]
        forwards += 1
        add_children(frontier, drafter.logits(feats), feats)

    ranked = keep_best(values, parents, depths, max(size, shape.tree_size) - 1)
    kept = ranked[: size - 1]  # `keep_best` of fewer nodes is a prefix of its ranking
    if estimates is not None:
        estimates.extend(math.exp(values[i]) for i in ranked[: shape.tree_size - 1])
    paths: dict[int, tuple[int, ...]] = {}
    for i in kept:  # parents come first
        paths[i] = (paths[parents[i]] if parents[i] >= 0 else ()) + (ranks[i],)
    spec = make_spec(list(paths.values()), name="eagle")
    token_of = {paths[i]: tokens[i] for i in kept}
    ordered = torch.tensor([root, *(token_of[p] for p in spec.paths)], dtype=torch.long, device=device)  # [N]
    return DraftTree(tokens=ordered, buffers=_buffers(spec, str(device))), forwards


class EagleTreeProposer(EagleProposer):
    """The EAGLE drafter drafting a dynamic tree per step (`draft_tree`, through the request's
    `eagle.EagleCursor`, whose cache also holds the ``(depth - 1) * topk`` expanded entries); its
    start, room and roll back are the chain proposer's."""

    def __init__(self, drafter, shape: EagleTree, sampling: SamplingConfig, generator: torch.Generator, vocab: int,
                 sample_device: torch.device) -> None:
        super().__init__(drafter, sampling, generator, vocab, sample_device)
        self.shape = shape
        self.extra_entries = (shape.depth - 1) * shape.topk

    def depth_room(self, depth: int) -> int:
        """``depth`` cut to what the request's drafter cache holds: ``topk`` entries per level but the last."""
        return self.cursor.depth_room(depth, self.shape.topk)

    def propose(self, v: TargetVerifier, gamma: int, limit: int) -> DraftTree | None:
        """A tree as deep as the shape, the budget, the deadline and the drafter's context let it (``limit``)."""
        return self.propose_tree(v, min(gamma, limit))

    def propose_tree(self, v: TargetVerifier, depth: int) -> DraftTree | None:
        """A tree at most ``depth`` deep and as wide as the target's context allows; None when the
        drafter is not in step with the sequence."""
        if not self.catch_up(v):
            return None
        room = v.target.max_context - v.target.cache_len
        size = min(self.shape.tree_size, room)
        with self.threads():
            tree, forwards = self.cursor.tree(self.shape, self.depth_room(depth), size, v.tokens[-1], v.device)
        v.stats.draft_forwards += forwards
        return tree
