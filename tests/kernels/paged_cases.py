"""Random ragged batches over a paged KV store, for the paged-attention tests."""

from __future__ import annotations

import torch


def ragged_case(seed: int, *, hq: int = 4, hkv: int = 2, d: int = 16, seqs=((5, 1), (30, 4), (0, 3), (17, 1)),
                tree: bool = False, dtype=torch.float32):
    """``seqs``: (cached prefix, new tokens) per sequence. Returns the kernel's arguments and the
    expected output from a per-query loop (independent of either implementation)."""
    gen = torch.Generator().manual_seed(seed)
    g = len(seqs)
    tq = max(t for _, t in seqs)
    lk = max(s + t for s, t in seqs)
    n = sum(t for _, t in seqs)
    slots_total = sum(s + t for s, t in seqs) + 7
    perm = torch.randperm(slots_total, generator=gen)  # sequences' slots scattered over the store
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k_store = torch.randn(slots_total, hkv, d, generator=gen).to(dtype)
    v_store = torch.randn(slots_total, hkv, d, generator=gen).to(dtype)
    q_index = torch.zeros(g, tq, dtype=torch.long)
    visible = torch.zeros(g, tq, dtype=torch.long)
    kv_slots = torch.zeros(g, lk, dtype=torch.long)
    mask = torch.zeros(g, tq, lk, dtype=torch.bool) if tree else None
    used = row = 0
    for i, (s, t) in enumerate(seqs):
        kv_slots[i, : s + t] = perm[used : used + s + t]
        used += s + t
        for j in range(t):
            q_index[i, j] = row + j
            if tree:  # a random tree among the new tokens: parent of node j is some node before it
                visible[i, j] = s + t
                mask[i, j, :s] = True
                mask[i, j, s + j] = True
                p = j
                while p > 0:
                    p = int(torch.randint(0, p, (1,), generator=gen))
                    mask[i, j, s + p] = True
            else:
                visible[i, j] = s + j + 1
        row += t
    scale = d ** -0.5
    want = torch.full((n, hq * d), float("nan"))
    group = hq // hkv
    for i, (s, t) in enumerate(seqs):
        for j in range(t):
            keys = [x for x in range(int(visible[i, j])) if mask is None or bool(mask[i, j, x])]
            slots = kv_slots[i, keys]
            for h in range(hq):
                kk = k_store[slots, h // group].double()
                vv = v_store[slots, h // group].double()
                w = torch.softmax(kk @ q[int(q_index[i, j]), h].double() * scale, dim=0)
                want[int(q_index[i, j]), h * d:(h + 1) * d] = (w @ vv).float()
    return dict(q=q, k_store=k_store, v_store=v_store, q_index=q_index, visible=visible, kv_slots=kv_slots,
                scale=scale, mask=mask), want


def paged_steps(backend, pool) -> list[torch.Tensor]:
    """Four forwards of a `PagedBackend` over three sequences (prefills, plain steps, a chain draft
    beside plain steps, trees beside a plain step); every returned row's logits, on the CPU."""
    from specops.engine.batch_forward import FeedItem
    from specops.engine.sequence import SeqKV

    gen = torch.Generator().manual_seed(3)
    seqs = [SeqKV(), SeqKV(), SeqKV()]
    logits = []

    def feed(lengths, trees=None):
        items = []
        for i, (kv, t) in enumerate(zip(seqs, lengths)):
            assert pool.grow(kv.blocks, kv.computed + t)
            tokens = torch.randint(0, backend.vocab_size, (t,), generator=gen).tolist()
            intra = positions = None
            if trees and trees[i]:
                intra = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, two children
                positions = [kv.computed, kv.computed + 1, kv.computed + 1]
            items.append(FeedItem(kv=kv, tokens=tokens, rows=list(range(t)), positions=positions, intra=intra))
        logits.extend(o.logits.cpu() for o in backend.forward(items))

    feed([6, 3, 9])  # prefills
    feed([1, 1, 1])  # plain decoding
    feed([4, 1, 1])  # a chain draft beside plain steps
    feed([3, 1, 3], trees=[True, False, True])  # trees
    return logits
