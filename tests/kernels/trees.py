"""Tree masks and naive attention/compaction loops shared by the kernel tests."""

from __future__ import annotations

import math

import torch


def chain_parents(nodes: int) -> list[int]:
    """A single chain: node i's parent is i - 1."""
    return [-1] + list(range(nodes - 1))


def wide_parents(nodes: int) -> list[int]:
    """A star: every node hangs off the root."""
    return [-1] + [0] * (nodes - 1)


def random_parents(nodes: int, gen: torch.Generator) -> list[int]:
    """A random tree in topological order: node i's parent is some earlier node."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]


def mask_from_parents(parents: list[int]) -> torch.Tensor:  # [T, T] bool
    """Node i may see node j iff j is i or one of its ancestors."""
    nodes = len(parents)
    mask = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def naive_tree_attention(q, k, v, tree_mask, scale) -> torch.Tensor:  # [B, Hq, T, D] float64
    """One node at a time: gather the prefix and the visible tree keys, softmax in float64."""
    batch, heads_q, nodes, head_dim = q.shape
    heads_kv = k.shape[1]
    prefix = k.shape[2] - nodes
    out = torch.zeros(batch, heads_q, nodes, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads_q):
            hk = h // (heads_q // heads_kv)
            for i in range(nodes):
                cols = list(range(prefix)) + [prefix + j for j in range(nodes) if tree_mask[i, j]]
                if not cols:
                    continue
                keys = k[b, hk, cols].double()  # [n, D]
                vals = v[b, hk, cols].double()
                logits = keys @ q[b, h, i].double() * scale  # [n]
                weights = torch.softmax(logits, dim=0)
                out[b, h, i] = weights @ vals
    return out


def naive_kv_compact(cache: torch.Tensor, start: int, keep: list[int]) -> torch.Tensor:
    """Sequential row moves in increasing order on a copy (safe for keep[i] >= i)."""
    out = cache.clone()
    for i, src in enumerate(keep):
        out[:, :, start + i] = out[:, :, start + src]
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
