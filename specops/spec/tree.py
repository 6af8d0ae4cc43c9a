"""Candidate trees for Medusa verification: topologies as data, buffers as tensors.

A tree node other than the root is named by its *path*: the tuple of top-k ranks
``(r_1, ..., r_d)`` taken from heads 1..d. Node ``(0, 2)`` is "head 1's best token,
then head 2's third best". The root (depth 0) is the token the target itself chose
for the next position. Every node's candidate token comes from the head at its depth
(Medusa heads do not condition on their parent), so siblings always carry distinct
tokens. A tree is valid when it is *prefix-closed*: every node's parent is in it.

``TreeSpec`` holds a topology (presets in ``PRESETS``, or ``sparse_tree`` built from
measured per-head top-k accuracy); ``build_buffers`` turns it into ``TreeBuffers``,
the tensors one verification forward needs. Nodes are flattened in (depth, path)
order, root first, so any prefix of the node list is itself a valid tree.

N tree nodes (root included) · K heads · D = max depth.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

TreePath = tuple[int, ...]


class TreeError(ValueError):
    """An invalid tree topology or tree request."""


@dataclass(frozen=True)
class TreeSpec:
    """A tree topology: the non-root nodes' paths, sorted by (depth, path)."""

    paths: tuple[TreePath, ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        """A hand-built spec must already be what `make_spec` builds: valid nodes, sorted by
        (depth, path), prefix-closed; anything else would give wrong parents and masks."""
        spec = make_spec(self.paths, self.name)  # raises TreeError naming the bad node
        if spec.paths != tuple(tuple(p) for p in self.paths):
            raise TreeError(
                f"tree {self.name!r}: paths must be sorted by (depth, path); build it with make_spec({list(self.paths)!r})"
            )
        object.__setattr__(self, "paths", spec.paths)

    @property
    def num_nodes(self) -> int:
        """N: tree nodes including the root."""
        return 1 + len(self.paths)

    @property
    def depth(self) -> int:
        """D: the deepest node's depth (0 for a root-only tree)."""
        return max((len(p) for p in self.paths), default=0)

    def top_k(self) -> int:
        """How many ranked candidates per head the tree reads (max rank + 1, at least 1)."""
        return 1 + max((r for p in self.paths for r in p), default=0)

    def limit(self, *, max_nodes: int | None = None, max_depth: int | None = None) -> TreeSpec:
        """The sub-tree of nodes at depth <= max_depth, then the first max_nodes - 1 of them."""
        paths = self.paths
        if max_depth is not None:
            paths = tuple(p for p in paths if len(p) <= max_depth)
        if max_nodes is not None:
            if max_nodes < 1:
                raise TreeError(f"max_nodes must be >= 1 (the root), got {max_nodes}")
            paths = paths[: max_nodes - 1]
        if paths == self.paths:
            return self
        return make_spec(paths, name=f"{self.name}[{1 + len(paths)}]")  # a prefix of a sorted tree stays valid


def make_spec(paths: Sequence[Sequence[int]], name: str = "custom") -> TreeSpec:
    """Validate paths (non-negative int ranks, unique, prefix-closed) and sort them."""
    seen: set[TreePath] = set()
    for raw in paths:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
            raise TreeError(f"tree {name!r}: each node must be a sequence of top-k ranks, got {raw!r}")
        path = tuple(raw)
        if not path:
            raise TreeError(f"tree {name!r}: the root is implicit; empty paths are not allowed")
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in path):
            raise TreeError(f"tree {name!r}: ranks must be non-negative ints, got {raw!r}")
        if path in seen:
            raise TreeError(f"tree {name!r}: duplicate node {path}")
        seen.add(path)
    for path in seen:
        if len(path) > 1 and path[:-1] not in seen:
            raise TreeError(f"tree {name!r}: node {path} has no parent {path[:-1]} (trees must be prefix-closed)")
    ordered = tuple(sorted(seen, key=lambda p: (len(p), p)))
    spec = object.__new__(TreeSpec)  # validated here: skip __post_init__'s second check
    object.__setattr__(spec, "paths", ordered)
    object.__setattr__(spec, "name", name)
    return spec


# Presets: hand-shaped trees, deepest first along rank-0 chains (heads' top-1 is by
# far their most accurate guess), widest near the root. Paths deeper than the number
# of heads in use are dropped by `preset`.
_PRESET_PATHS: dict[str, tuple[TreePath, ...]] = {
    "chain": ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)),
    "small": ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 1), (0, 0, 0, 0)),
    "medium": (
        (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 0, 0, 0),
    ),
    "large": (
        (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0),
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (2, 0, 0),
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
        (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 1, 0), (0, 0, 1, 0, 0),
        (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0),
    ),
}
PRESETS: tuple[str, ...] = tuple(_PRESET_PATHS)


@functools.lru_cache(maxsize=64)
def preset(name: str, num_heads: int) -> TreeSpec:
    """A preset tree restricted to depth <= num_heads."""
    if name not in _PRESET_PATHS:
        raise TreeError(f"unknown tree preset {name!r}; known: {', '.join(PRESETS)}")
    if num_heads < 1:
        raise TreeError(f"num_heads must be >= 1, got {num_heads}")
    return make_spec([p for p in _PRESET_PATHS[name] if len(p) <= num_heads], name=name)


def _check_accuracy(accuracy: Sequence[Sequence[float]]) -> list[list[float]]:
    rows = [[float(a) for a in row] for row in accuracy]
    if not rows or any(not row for row in rows):
        raise TreeError("accuracy must be a non-empty [K][k] table of per-head, per-rank probabilities")
    for d, row in enumerate(rows):
        if any(not 0.0 <= a <= 1.0 for a in row) or sum(row) > 1.0 + 1e-6:
            raise TreeError(f"accuracy row {d} must hold probabilities in [0, 1] summing to <= 1, got {row}")
    return rows


def ranked_nodes(accuracy: Sequence[Sequence[float]], max_nodes: int) -> list[tuple[TreePath, float]]:
    """Up to ``max_nodes - 1`` non-root nodes, best first, with their estimated acceptance.

    ``accuracy[d][r]`` is the measured probability that head ``d+1``'s rank-``r`` token
    is the true one. Treating heads as independent, a node is accepted with
    probability ``prod_i accuracy[i][r_i]`` along its path. That value never grows
    along a path, so a best-first search from the root yields, for every n, the
    prefix-closed n-node tree with the largest expected accepted length (Medusa's
    sparse-tree construction).
    """
    rows = _check_accuracy(accuracy)
    if max_nodes < 1:
        raise TreeError(f"max_nodes must be >= 1, got {max_nodes}")
    heap: list[tuple[float, int, TreePath]] = [(-rows[0][r], 1, (r,)) for r in range(len(rows[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[TreePath, float]] = []
    while heap and len(chosen) < max_nodes - 1:
        neg, depth, path = heapq.heappop(heap)
        chosen.append((path, -neg))
        if depth < len(rows):
            for r, a in enumerate(rows[depth]):
                heapq.heappush(heap, (neg * a, depth + 1, path + (r,)))
    return chosen


def sparse_tree(accuracy: Sequence[Sequence[float]], num_nodes: int) -> TreeSpec:
    """The ``num_nodes``-node tree with the highest expected accepted length."""
    return make_spec([p for p, _ in ranked_nodes(accuracy, num_nodes)], name=f"sparse{num_nodes}")


def expected_accept_length(spec: TreeSpec, accuracy: Sequence[Sequence[float]]) -> float:
    """Expected tokens emitted per verification under greedy decoding: 1 + sum of node
    acceptance probabilities (at most one node per depth can match the target)."""
    rows = _check_accuracy(accuracy)
    total = 1.0
    for path in spec.paths:
        if len(path) > len(rows):
            raise TreeError(f"node {path} is deeper than the {len(rows)} heads in the accuracy table")
        prob = 1.0
        for depth, rank in enumerate(path):
            prob *= rows[depth][rank] if rank < len(rows[depth]) else 0.0
        total += prob
    return total


@dataclass(frozen=True)
class TreeBuffers:
    """Everything one tree verification needs, built once per topology.

    The first ``spec.num_nodes`` nodes are the heads' (``spec``'s topology); a tree with a
    prompt-lookup branch merged into it (`specops.spec.medusa_branch.merge_branch`) has
    ``appended`` more after them, nodes of explicit tokens that no head ranked."""

    spec: TreeSpec
    attn_mask: Tensor  # [N, N] bool: node i may attend to node j (j is i or an ancestor of i)
    depth: Tensor  # [N] long: 0 for the root; position id offset from the prefix length
    parent: Tensor  # [N] long: parent node index, -1 for the root
    candidate_index: Tensor  # [spec.num_nodes - 1] long: node i+1's token in the flattened [D, top_k] candidates
    retrieve: Tensor  # [P, D + 1] long: node indices of each root-to-leaf path, padded with -1
    children: tuple[tuple[int, ...], ...]  # children[i]: node indices whose parent is i
    top_k: int  # ranked candidates read per head
    appended: int = 0  # nodes after the spec's: a merged branch's tokens

    @property
    def num_nodes(self) -> int:
        return self.spec.num_nodes + self.appended


def node_parents(spec: TreeSpec) -> list[int]:
    """Parent index of every node in flattened order (-1 for the root)."""
    index = {path: i + 1 for i, path in enumerate(spec.paths)}
    return [-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in spec.paths]


def ancestor_mask(parents: Sequence[int]) -> Tensor:  # -> [N, N] bool
    """mask[i, j] = j is i or one of i's ancestors. Parents precede children."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def leaf_paths(parents: Sequence[int]) -> Tensor:  # -> [P, D + 1] long
    """Root-to-leaf node index paths, one row per leaf, padded with -1."""
    n = len(parents)
    has_child = [False] * n
    for p in parents:
        if p >= 0:
            has_child[p] = True
    rows = []
    for leaf in (i for i in range(n) if not has_child[i]):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        rows.append(path[::-1])
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)


def build_buffers(spec: TreeSpec, device: torch.device | str = "cpu") -> TreeBuffers:
    """Turn a topology into tensors on ``device``."""
    parents = node_parents(spec)
    top_k = spec.top_k()
    children: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    return TreeBuffers(
        spec=spec,
        attn_mask=ancestor_mask(parents).to(device),
        depth=torch.tensor([0] + [len(p) for p in spec.paths], dtype=torch.long, device=device),
        parent=torch.tensor(parents, dtype=torch.long, device=device),
        candidate_index=torch.tensor([(len(p) - 1) * top_k + p[-1] for p in spec.paths], dtype=torch.long,
                                     device=device),
        retrieve=leaf_paths(parents).to(device),
        children=tuple(tuple(c) for c in children),
        top_k=top_k,
    )


def resolve_tree(tree: str | TreeSpec | Sequence[Sequence[int]] | None, num_heads: int,
                 accuracy: Sequence[Sequence[float]] | None = None, num_nodes: int | None = None) -> TreeSpec:
    """A request's ``tree=`` argument as a TreeSpec no deeper than ``num_heads``.

    ``None`` means the sparse tree from ``accuracy`` with ``num_nodes`` nodes (the
    caller picks ``num_nodes`` from the measured verify cost), or the "small" preset
    when no accuracy was measured; a string names a preset; a sequence of paths is an
    explicit tree.
    """
    if tree is None:
        if accuracy:
            spec = sparse_tree([row for row in accuracy][:num_heads], num_nodes or 8)
        else:
            spec = preset("small", num_heads)
    elif isinstance(tree, str):
        spec = preset(tree, num_heads)
    elif isinstance(tree, TreeSpec):
        spec = tree
    else:
        spec = make_spec(tree)
    if spec.depth > num_heads:
        raise TreeError(f"tree {spec.name!r} is {spec.depth} deep but only {num_heads} Medusa heads are in use")
    return spec
