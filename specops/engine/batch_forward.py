"""One model forward over a ragged batch of sequences: the paged fast path and the generic path.

Every sequence in a step contributes a `FeedItem`: the tokens it feeds (its uncomputed
committed tokens, then its drafts or tree nodes), their rotary positions, the attention
pattern among them (causal, or a tree mask) and which of them need logits. A backend
runs all items and leaves each sequence's KV counter at ``start + len(tokens)``; the
engine then rolls it back to the accepted prefix (`truncate`) or compacts an accepted
tree path (`compact`).

* `PagedBackend` (Llama / Mistral / Qwen2 through `FastLlamaRunner`'s weights): ONE
  batched forward for the whole step over a block-paged cache (`PagedLlama`).
* `GenericBackend` (any transformers causal LM, e.g. GPT-2): honestly slower — one
  forward per sequence through a private `HFRunner` (transformers' DynamicCache) per
  sequence. Memory is still accounted in blocks of the same `BlockPool`, so the budget
  and preemption rules are the same; the storage is not shared across sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specops.models.hf_runner import HFRunner
from specops.models.paged_llama import AttnGroup, PagedBatch, PagedLlama, kv_bytes_per_token
from specops.kernels import cpu_linear
from specops.kernels.cpu_linear import MAX_MASK_NODES
from specops.engine.kv_pool import BlockPool, blocks_for
from specops.engine.sequence import SeqKV


SHORT_BLOCK = 16  # items feeding more tokens than this (prefills) get their own attention call
SHORT_BUCKETS = (1, 8, SHORT_BLOCK)  # short items share a padded attention call per length bucket


@dataclass
class FeedItem:
    """What one sequence feeds one model in one forward."""

    kv: SeqKV
    tokens: list[int]  # T new tokens; they occupy cache positions kv.computed .. kv.computed + T - 1
    rows: list[int]  # offsets into tokens whose logits are returned, in order
    positions: list[int] | None = None  # T rotary positions; None: kv.computed + arange(T)
    intra: Tensor | None = None  # [T, T] bool: token i may see new token j; None: causal
    hidden_only: int = 0
    """The first this many of ``rows`` need their hidden states alone, no logits (an EAGLE
    sequence's prompt pass: its drafter reads every position). The C stack then skips the LM
    head for them and the item's logits are its last ``len(rows) - hidden_only`` rows; other
    backends return logits for every row."""


@dataclass
class ItemOutput:
    logits: Tensor  # [r, V] float32
    hidden: Tensor | None  # [r, E]
    step_logits: Tensor | None = None  # the step's whole [R, V] logits, ``logits`` its rows row0..row0+r-1
    row0: int = 0


def _split_outputs(items: list[FeedItem], logits: Tensor, hidden: Tensor | None,
                   heads_only: bool = False) -> list[ItemOutput]:
    """Each item's rows of a batched forward's logits [R, V] (and hidden [R, E]); advances its KV
    counter. ``heads_only``: ``logits`` holds only the rows that are not `FeedItem.hidden_only`."""
    outs: list[ItemOutput] = []
    r0 = h0 = 0
    for it in items:
        h = len(it.rows)
        r = h - it.hidden_only if heads_only else h
        outs.append(ItemOutput(logits[r0 : r0 + r], None if hidden is None else hidden[h0 : h0 + h], logits, r0))
        r0 += r
        h0 += h
        it.kv.computed += len(it.tokens)
    return outs


class PagedBackend:
    """A `FastLlamaRunner`'s weights over a paged cache of ``pool.num_blocks`` blocks."""

    paged = True

    def __init__(self, runner, pool: BlockPool) -> None:
        self.model = PagedLlama(runner, pool.num_blocks, pool.block_size)
        self.pool = pool
        self.device = runner.device
        self.vocab_size = runner.vocab_size
        self.max_context = runner.max_context
        self.bs = pool.block_size
        self._arange = torch.arange(self.bs, device=self.device)  # [bs]

    def _slots(self, kv: SeqKV, positions: list[int]) -> list[int]:
        bs, table = self.bs, kv.blocks
        return [table[p // bs] * bs + p % bs for p in positions]

    def forward(self, items: list[FeedItem], need_hidden: bool = False) -> list[ItemOutput]:
        if self.model.c_layers and all(it.intra is None or len(it.tokens) <= MAX_MASK_NODES for it in items):
            return self._forward_c(items, need_hidden)
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        write: list[int] = []
        rows: list[int] = []
        offsets: list[int] = []
        for it in items:
            s, t = it.kv.computed, len(it.tokens)
            if len(it.kv.blocks) * self.bs < s + t:
                raise RuntimeError(f"sequence needs {s + t} slots but holds {len(it.kv.blocks)} blocks")
            offsets.append(len(ids))
            rows.extend(len(ids) + r for r in it.rows)
            ids.extend(it.tokens)
            pos.extend(range(s, s + t) if it.positions is None else it.positions)
            write.extend(self._slots(it.kv, range(s, s + t)))
        # short blocks share padded attention calls by length bucket (plain steps, short drafts,
        # trees): one sequence speculating never pads every plain step of a large batch to its
        # draft length. Each long prefill gets its own call.
        buckets: dict[int, list[int]] = {}
        groups = []
        for i, it in enumerate(items):
            t = len(it.tokens)
            if t > SHORT_BLOCK:
                groups.append([i])
            else:
                buckets.setdefault(next(k for k, top in enumerate(SHORT_BUCKETS) if t <= top), []).append(i)
        groups += buckets.values()
        groups.sort(key=lambda g: g[0])
        batch = PagedBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            write_slots=torch.tensor(write, dtype=torch.long, device=dev),
            groups=[self._group([items[i] for i in g], [offsets[i] for i in g]) for g in groups],
            logit_rows=torch.tensor(rows, dtype=torch.long, device=dev),
        )
        logits, hidden = self.model.forward(batch, need_hidden)  # [R, V], [R, E]
        return _split_outputs(items, logits, hidden)

    def _layout(self, items: list[FeedItem], extra: list[int] | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """The C kernels' view of a ragged batch: first [S+1] (flat token offsets), start [S]
        (cached tokens), tables [S, blocks] int32 and the flat token ids; each sequence must
        hold blocks for its tokens plus ``extra[i]`` more slots."""
        s = len(items)
        first = np.zeros(s + 1, dtype=np.int64)
        start = np.empty(s, dtype=np.int64)
        width = max(len(it.kv.blocks) for it in items)
        tables = np.zeros((s, max(width, 1)), dtype=np.int32)
        ids: list[int] = []
        for i, it in enumerate(items):
            need = it.kv.computed + len(it.tokens) + (extra[i] if extra else 0)
            if len(it.kv.blocks) * self.bs < need:
                raise RuntimeError(f"sequence needs {need} slots but holds {len(it.kv.blocks)} blocks")
            start[i] = it.kv.computed
            tables[i, : len(it.kv.blocks)] = it.kv.blocks
            ids.extend(it.tokens)
            first[i + 1] = len(ids)
        return first, start, tables, ids

    def _forward_c(self, items: list[FeedItem], need_hidden: bool) -> list[ItemOutput]:
        """The whole step in one C call (`PagedLlama.forward_ragged`): no attention groups, no
        padding; each sequence's key list is read from its block table inside the kernel."""
        first, start, tables, ids = self._layout(items)
        masked = np.zeros(len(items), dtype=np.int8)
        pos: list[int] = []
        rows: list[int] = []
        trees: list[tuple[int, FeedItem]] = []
        for i, it in enumerate(items):
            c, t = it.kv.computed, len(it.tokens)
            rows.extend(int(first[i]) + r for r in it.rows)
            pos.extend(range(c, c + t) if it.positions is None else it.positions)
            if it.intra is not None:
                trees.append((i, it))
        words = np.zeros(len(ids), dtype=np.int64)  # causal sequences need no words
        for i, it in trees:
            masked[i] = 1
            words[first[i] : first[i + 1]] = cpu_linear.mask_bits(it.intra).numpy()
        batch = cpu_linear.RaggedBatch(positions=np.asarray(pos, dtype=np.int32), first=first, start=start,
                                       tables=tables, block_size=self.bs, words=words, masked=masked)
        head_rows = None
        if any(it.hidden_only for it in items):  # the LM head only where logits are read
            head_rows, h0 = [], 0
            for it in items:
                head_rows.extend(range(h0 + it.hidden_only, h0 + len(it.rows)))
                h0 += len(it.rows)
            head_rows = torch.tensor(head_rows, dtype=torch.long)
        logits, hidden = self.model.forward_ragged(torch.tensor(ids, dtype=torch.long),
                                                   batch, torch.tensor(rows, dtype=torch.long), need_hidden, head_rows)
        return _split_outputs(items, logits, hidden, heads_only=head_rows is not None)

    def draft_chain(self, items: list[FeedItem], gammas: list[int], clock_id: int | None = None, *,
                    inv_temps: list[float] | None = None, uniforms: np.ndarray | None = None,
                    ) -> tuple[list[list[int]], list[float] | None, Tensor | None] | None:
        """Drafting rounds in one C call (`PagedLlama.draft_ragged`): each item feeds its tokens in
        round 0 (causal, logits of its last row), then one token per round, the previous one
        chosen, until it has its ``gammas[i]`` (>= 1) tokens; each KV counter ends at ``computed +
        len(tokens) + gammas[i] - 1``. A token is the argmax, or for an item with ``inv_temps[i] >
        0`` (1 / temperature) a draw from softmax(logits * inv_temps[i]) with ``uniforms[i, r]``
        ([S, max(gammas)] float64 in [0, 1)). Returns the tokens, with ``clock_id`` each round's
        seconds, and the sampled items' q rows [S, max(gammas), V] (None when nothing sampled);
        None, with nothing done, where the C path does not apply (the caller loops)."""
        if (not self.model.c_layers or not items or len(items) != len(gammas)
                or min(gammas) < 1 or not self.model.r.embed.is_contiguous()
                or any(not it.tokens or it.intra is not None or it.positions is not None for it in items)):
            return None
        first, start, tables, ids = self._layout(items, [g - 1 for g in gammas])
        s = len(items)
        batch = cpu_linear.RaggedBatch(positions=np.zeros(0, dtype=np.int32), first=first, start=start, tables=tables,
                                       block_size=self.bs, words=np.zeros(0, dtype=np.int64),
                                       masked=np.zeros(s, dtype=np.int8))
        q = None
        if inv_temps is not None and any(t > 0 for t in inv_temps):
            q = torch.empty(s, max(gammas), self.model.r.lm_head.weight.shape[0], dtype=torch.float32)
        else:
            inv_temps = uniforms = None
        tokens, rounds = self.model.draft_ragged(ids, batch, gammas, clock_id, uniforms=uniforms,
                                                 inv_temps=None if q is None else np.asarray(inv_temps, np.float32),
                                                 q_out=q)
        for it, g in zip(items, gammas):
            it.kv.computed += len(it.tokens) + g - 1
        return tokens, rounds, q

    def _group(self, items: list[FeedItem], offsets: list[int]) -> AttnGroup:
        """One padded attention call over ``items`` (whose flat tokens start at ``offsets``)."""
        dev = self.device
        b = len(items)
        starts = [it.kv.computed for it in items]
        lens = [len(it.tokens) for it in items]
        tq = max(lens)
        lk = max(s + t for s, t in zip(starts, lens))
        nblk = blocks_for(lk, self.bs)
        q_rows: list[list[int]] = []
        table_rows: list[list[int]] = []
        padded: list[int] = []
        flat: list[int] = []
        for i, (it, off) in enumerate(zip(items, offsets)):
            s, t = starts[i], lens[i]
            q_rows.append(list(range(off, off + t)) + [0] * (tq - t))
            padded.extend(range(i * tq, i * tq + t))
            flat.extend(range(off, off + t))
            used = it.kv.blocks[: blocks_for(s + t, self.bs)]
            table_rows.append(used + [0] * (nblk - len(used)))
        q_index = torch.tensor(q_rows, dtype=torch.long)  # [G, Tq]
        tables = torch.tensor(table_rows, dtype=torch.long)  # [G, blocks]
        kv_slots = (tables[:, :, None] * self.bs + self._arange.cpu()).view(b, -1)[:, :lk]  # [G, Lk]
        tree = any(it.intra is not None for it in items)
        if self.model.kernel_group(tq, tree):
            if tree:  # (the GPU kernel) each real query sees its sequence's keys as far as the mask allows
                visible = [[s + t if i < t else 0 for i in range(tq)] for s, t in zip(starts, lens)]
                mask = self._mask(items, starts, lens, tq, lk).to(dev)
            else:  # prefix-shaped masks: the kernel needs only the key counts
                visible = [[s + i + 1 if i < t else 0 for i in range(tq)] for s, t in zip(starts, lens)]
                mask = None
            return AttnGroup(q_index=q_index.to(dev), kv_slots=kv_slots.to(dev), mask=mask,
                             padded_rows=torch.tensor(padded, dtype=torch.long, device=dev),
                             flat_rows=torch.tensor(flat, dtype=torch.long, device=dev),
                             visible=torch.tensor(visible, dtype=torch.long, device=dev))
        return AttnGroup(
            q_index=q_index.to(dev),
            kv_slots=kv_slots.to(dev),
            mask=self._mask(items, starts, lens, tq, lk).to(dev),  # [G, 1, Tq, Lk]
            padded_rows=torch.tensor(padded, dtype=torch.long, device=dev),
            flat_rows=torch.tensor(flat, dtype=torch.long, device=dev),
        )

    @staticmethod
    def _mask(items: list[FeedItem], starts: list[int], lens: list[int], tq: int, lk: int) -> Tensor:
        keys = torch.arange(lk)  # [Lk]
        if tq == 1:  # plain decoding steps: each query sees its prefix and itself
            ends = torch.tensor([s + 1 for s in starts])  # [G]
            return (keys[None, :] < ends[:, None])[:, None, None, :]  # [G, 1, 1, Lk]
        # built for the whole group at once (a per-sequence loop cost ~4 tensor ops per sequence)
        s = torch.tensor(starts)[:, None, None]  # [G, 1, 1]
        t = torch.tensor(lens)[:, None, None]  # [G, 1, 1]
        q = torch.arange(tq)[None, :, None]  # [1, Tq, 1]
        k = keys[None, None, :]  # [1, 1, Lk]
        real = q < t  # [G, Tq, 1]
        mask = real & ((k < s) | ((k >= s) & (k - s <= q)))  # [G, Tq, Lk]: prefix, then causal
        for i, it in enumerate(items):
            if it.intra is not None:  # a tree: its own pattern among the new tokens
                mask[i, : lens[i], starts[i] : starts[i] + lens[i]] = it.intra.cpu()
        mask[:, :, 0] |= ~real[:, :, 0]  # padded queries: any finite row (their output is dropped)
        return mask[:, None]

    def truncate(self, kv: SeqKV, length: int) -> None:
        """Keep the first ``length`` entries; blocks past them go back to the pool at once."""
        kv.computed = min(kv.computed, length)
        self.pool.shrink(kv.blocks, kv.computed)

    def compact(self, kv: SeqKV, start: int, keep: list[int]) -> None:
        """Entry start + keep[i] moves to start + i; the sequence then holds start + len(keep)."""
        n = len(keep)
        moves = [(start + k, start + i) for i, k in enumerate(keep) if k != i]
        if moves:
            src = torch.tensor(self._slots(kv, [m[0] for m in moves]), dtype=torch.long, device=self.device)
            dst = torch.tensor(self._slots(kv, [m[1] for m in moves]), dtype=torch.long, device=self.device)
            self.model.copy_slots(src, dst)
        self.truncate(kv, start + n)

    def release(self, kv: SeqKV) -> None:
        self.pool.release(kv.blocks)
        kv.computed = kv.published = 0


class GenericBackend:
    """Any transformers causal LM: one forward per sequence on its own `HFRunner` (slower)."""

    paged = False

    def __init__(self, model, pool: BlockPool, max_context: int) -> None:
        self.hf_model = model
        self.pool = pool
        self.max_context = max_context
        first = next(model.parameters())
        self.device = first.device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])

    def forward(self, items: list[FeedItem], need_hidden: bool = False) -> list[ItemOutput]:
        outs = []
        for it in items:
            kv = it.kv
            if kv.runner is None:
                kv.runner = HFRunner(self.hf_model, max_context=self.max_context)
            runner = kv.runner
            if kv.computed == 0 and runner.cache_len:
                runner.reset(1)
            if runner.cache_len != kv.computed:
                raise RuntimeError(f"generic cache holds {runner.cache_len} entries, expected {kv.computed}")
            ids = torch.tensor([it.tokens], dtype=torch.long, device=self.device)  # [1, T]
            pos = None
            if it.positions is not None:
                pos = torch.tensor([it.positions], dtype=torch.long, device=self.device)  # [1, T]
            out = runner.forward(ids, position_ids=pos, tree_mask=it.intra, need_hidden=need_hidden)
            rows = torch.tensor(it.rows, dtype=torch.long, device=self.device)  # [r]
            hidden = None if out.hidden is None else out.hidden[0, rows]  # [r, E]
            outs.append(ItemOutput(out.logits[0, rows], hidden))  # [r, V]
            kv.computed += len(it.tokens)
        return outs

    def truncate(self, kv: SeqKV, length: int) -> None:
        kv.computed = min(kv.computed, length)
        if kv.runner is not None and kv.runner.cache_len > kv.computed:
            kv.runner.truncate(kv.computed)
        self.pool.shrink(kv.blocks, kv.computed)

    def compact(self, kv: SeqKV, start: int, keep: list[int]) -> None:
        kv.runner.compact(start, torch.tensor(keep, dtype=torch.long))
        kv.computed = start + len(keep)
        self.pool.shrink(kv.blocks, kv.computed)

    def release(self, kv: SeqKV) -> None:
        self.pool.release(kv.blocks)
        kv.computed = kv.published = 0
        kv.runner = None


def bytes_per_token(runner) -> int:
    """KV bytes one token slot costs for a runner (fast or generic)."""
    if hasattr(runner, "layers") and hasattr(runner, "n_kv_heads"):
        return kv_bytes_per_token(runner)
    cfg = runner.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head")
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    elem = torch.empty((), dtype=runner.dtype).element_size()
    return layers * 2 * kv_heads * head_dim * elem


def make_backend(runner, pool: BlockPool):
    """The paged backend for a `FastLlamaRunner`, else the generic one (an `HFRunner`'s model)."""
    if hasattr(runner, "layers") and hasattr(runner, "lm_head"):
        return PagedBackend(runner, pool)
    return GenericBackend(runner.model, pool, runner.max_context)
