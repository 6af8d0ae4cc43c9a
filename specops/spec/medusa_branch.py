"""Medusa's prompt-lookup branch: which tokens it drafts, and their trie merge into the heads' tree.

When a greedy Medusa step's context ends in three tokens that occurred before
(`ngram.NgramIndex.match`, full-length matches only), the tokens that followed them join
the step's tree as one more branch from the root (`branch_tokens`; more after a match that
runs back further: `branch_length`). `merge_branch` merges them as into a
trie: from the root, a branch token equal to the token of a child of the node reached so
far reuses that child; the rest hang under the last node reached as a chain of new nodes,
numbered after the tree's. Siblings keep distinct tokens, so the greedy walk
(`tree_verify.verify_tree_greedy`) follows one path and keeps the longer accepted one: the
heads' guess or the repetition. One forward verifies both; the output is the target's own
either way.

The library's one-call C step (`medusa_decode.c_step`, `specops_medusa_step`) merges the
same way inside the kernel; its Python steps (`generate_medusa` off that path) and the
serving engine's greedy Medusa sequences (`specops.engine.engine`) merge here, so a step
proposes the same tree on every path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from specops.models.fast_llama import C_LAYERS_MAX_T
from specops.spec.ngram import MATCH_SPAN, NgramIndex
from specops.spec.tree import TreeBuffers, TreeSpec, leaf_paths

LOOKUP_BRANCH = 4  # default length of the prompt-lookup branch a greedy step adds to its tree
BRANCH_MAX_SCALE = 3  # a long match's branch is up to this many times ``lookup_branch`` (`branch_length`)


def branch_length(usual: int, length: int) -> int:
    """Tokens of the prompt-lookup branch after a full-length match ``length`` tokens long
    (`NgramIndex.match`): ``usual`` (the ``lookup_branch`` option), twice that from 8 tokens,
    three times from MATCH_SPAN (16) on. A match that runs back further is followed further
    (on the bundled code suite 81% of 16-token matches' next 8 tokens were the target's own,
    against 15% after 3-4-token ones: see `ngram.match_gamma`). Alternated per prompt with a
    fixed branch of 4 (`bench decode`'s suites, 128 tokens, 3 rounds, two runs each): Medusa on
    code 1.52 -> 1.61x and 1.77 -> 1.78x `ar` (target forwards 849 -> 756 and 809 -> 749);
    auto on the mixed suite 1.40 -> 1.47x and 1.29 -> 1.43x. A fixed branch of 8 read about
    as the fixed 4 (1.55 / 1.70x against 1.53 / 1.69x)."""
    if length < 8:
        return usual
    return (2 if length < MATCH_SPAN else BRANCH_MAX_SCALE) * usual


def context_index(tokens: Sequence[int]) -> NgramIndex:
    """The n-gram index a branch is looked up in, over ``tokens`` (prompt and output so far)."""
    index = NgramIndex()
    index.extend(list(tokens))
    return index


def branch_room(specs: Iterable[TreeSpec], usual: int) -> int:
    """Nodes a step with a branch may feed: the largest of ``specs``, or up to
    ``BRANCH_MAX_SCALE`` x ``usual`` more for the branch where C_LAYERS_MAX_T allows (the
    nodes `medusa_decode.c_steps` sizes the one-call step loop to)."""
    nodes = max(spec.num_nodes for spec in specs)
    return max(nodes, min(nodes + BRANCH_MAX_SCALE * usual, C_LAYERS_MAX_T))


def branch_tokens(index: NgramIndex | None, usual: int, drafts: int, space: int) -> list[int] | None:
    """The branch after ``index``'s full-length match (None: no match that long, or no room):
    `branch_length` tokens for the match's length and the usual length ``usual``,
    at most ``drafts`` (what the budget lets the step draft) and ``space`` (the nodes the step
    may add beside its tree)."""
    found = index.match() if index is not None and usual > 0 else None
    if found is None or found[1] < index.max_ngram:
        return None
    start, length = found
    cap = min(branch_length(usual, length), drafts, space)
    if cap <= 0:
        return None
    return index.continuation(start, cap) or None


def merge_branch(tokens: Tensor, buffers: TreeBuffers, branch: Sequence[int] | None
                 ) -> tuple[Tensor, TreeBuffers]:
    """``tokens`` [N] (root first) and ``buffers`` of a tree with ``branch`` (tokens drafted after
    the root) merged into it as into a trie (module docstring): the tree's nodes keep their
    indices, new nodes follow them (``TreeBuffers.appended``). A branch that adds no node (empty,
    or already a path of the tree) gives ``tokens`` and ``buffers`` back as they are."""
    n = buffers.num_nodes
    if not branch:
        return tokens, buffers
    toks = tokens.tolist()
    parent = buffers.parent.tolist()
    depth = buffers.depth.tolist()
    children = [list(c) for c in buffers.children]
    at = 0
    for tok in branch:
        child = next((c for c in children[at] if toks[c] == tok), None)
        if child is None:
            child = len(toks)
            toks.append(int(tok))
            parent.append(at)
            depth.append(depth[at] + 1)
            children[at].append(child)
            children.append([])
        at = child
    m = len(toks)
    if m == n:
        return tokens, buffers
    device = buffers.attn_mask.device
    # the appended nodes see their ancestors (the node they hang under and its own, then the chain) and themselves
    rows, cols = [], []
    for i in range(n, m):
        node = i
        while node >= 0:
            rows.append(i)
            cols.append(node)
            node = parent[node]
    mask = torch.zeros(m, m, dtype=torch.bool, device=device)
    mask[:n, :n] = buffers.attn_mask
    mask[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = True
    merged = TreeBuffers(
        spec=buffers.spec,
        attn_mask=mask,
        depth=torch.tensor(depth, dtype=torch.long, device=device),
        parent=torch.tensor(parent, dtype=torch.long, device=device),
        candidate_index=buffers.candidate_index,
        retrieve=leaf_paths(parent).to(device),
        children=tuple(tuple(c) for c in children),
        top_k=buffers.top_k,
        appended=buffers.appended + m - n,
    )
    return torch.tensor(toks, dtype=torch.long, device=tokens.device), merged


def branch_accepted(branch: Sequence[int], tokens: Sequence[int]) -> int:
    """How many of ``branch``'s tokens a step's accepted ``tokens`` (after the root) begin with."""
    n = 0
    for drafted, accepted in zip(branch, tokens):
        if drafted != accepted:
            break
        n += 1
    return n
