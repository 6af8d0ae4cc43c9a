"""EAGLE feature drafting in the serving engine: one drafter cache per sequence.

The drafter (`specops.models.eagle_model.EagleDrafter`, the model `Decoder(eagle=...)`
loaded) is shared; each sequence's `EagleState` holds a `specops.spec.eagle.EagleCursor`,
the same per-sequence drafter state `Decoder.generate(method="eagle")` drives: its own drafter
KV cache (sized to the sequence's most tokens and a tree's expanded levels, allocated at its
first drafting), the real entries fed and those waiting, and the drafter's prediction of the
pending token's feature. The cursor drafts `draft_chain`, or, for a greedy request whose
settings ask for one (`SpecSettings.eagle_tree`), EAGLE-2's dynamic tree (`draft_tree`), and
cuts its cache back to the real entries after; so a sequence proposes what the library
proposes from the same state.

What is the engine's own is where the real features come from:

* every target forward of an active sequence returns its hidden rows (the forward asks for
  hidden states whenever one is in the batch); `observe` keeps them and `commit` hands the
  cursor the rows of the positions the step committed (pending token, accepted drafts) — on a
  plain step one row, on a speculative one the accepted prefix's — which wait there until the
  sequence next drafts (`catch_up`, one drafter step), so a step the planner declined costs no
  drafter forward;
* a prefill or a recompute (after preemption) feeds the whole sequence, and its item asks
  for the hidden states of every row and the logits of the last (`FeedItem.hidden_only`: the
  C stack skips the LM head for the others, `full_rows`); `observe` keeps the hidden rows and
  hands the verification only the last row;
* the hidden rows of every block an active sequence publishes to the prefix cache are kept beside
  it, by the block's chain hash (`store`, at most one entry per pool block, least recently used
  out first: about ``hidden / (2 * layers * kv_heads * head_dim)`` of the KV it caches, 5% on
  SmolLM2-135M). A later active sequence reuses the cached blocks whose rows are kept
  (`has_features`, the scheduler's match) and its cursor is fed those rows (`observe`), so an
  EAGLE request finds its prompt in the prefix cache as any other does; blocks other methods
  published carry no rows, and the sequence computes them itself;
* a tree is verified as a Medusa tree is (the engine's batched forward with its tree mask,
  `tree_verify.judge_tree`, the target's cache compacted to the accepted path). Its item returns
  every node's hidden row; `commit` keeps the rows of the accepted path, root first, in path order
  (tree rows, not a block of positions): the features of the positions the step committed, as the
  library's `EagleProposer.sync` keeps them after a tree step.

A preempted sequence loses its drafter state with its target blocks (`release`) and is
rebuilt from its recompute's hidden rows. A sequence stops drafting for good once it outgrows
the drafter's context (`draft_room`, ``fallback_reason`` "draft_context", its state freed
at that commit), or past its deadline; it then decodes plainly, and its later (re)admissions may
reuse cached prompt blocks. Greedy verification makes the output the target's whatever the
drafter proposes; sampled drafts hand their q rows to `speculation.judge_block`.

Sampled requests keep the chain: its rejection sampling against the drafter's q is lossless.
The drafter runs sequence by sequence (a chain is γ one-token steps, a tree one forward per
level); the planner charges it as a per-sequence overhead measured from the engine's own steps,
as it does n-gram lookups and Medusa trees, trees apart from chains. The per-sequence caches
live outside the paged KV budget (one layer: ``2 * kv_heads * head_dim`` values per token of
the sequence, and a tree's expanded levels).

The engine runs EAGLE-1 drafters: an EAGLE-3 drafter (`specops.models.eagle3_model`) reads
intermediate target hidden states its batched forwards do not return, and is refused when the
engine is built (``specops serve --eagle PATH`` refuses such a folder before loading anything).
"""

from __future__ import annotations

import collections
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specops.spec.eagle import EagleCursor, torch_single_thread
from specops.models.eagle_model import EagleError
from specops.spec.eagle_tree import EagleTree
from specops.spec.speculation import draft_room
from specops.spec.step import DraftTree
from specops.engine.batch_forward import FeedItem, ItemOutput
from specops.engine.kv_pool import BlockPool
from specops.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EagleState:
    """One sequence's drafter state (see the module docstring)."""

    cursor: EagleCursor
    """The drafter cache and the real entries fed and waiting (`EagleCursor`); out of step once the
    sequence can never draft again (outgrew the drafter, deadline), holding nothing."""
    shape: EagleTree | None = None
    """The EAGLE-2 tree a greedy request drafts each step (`SpecSettings.eagle_tree`); None: the chain."""
    hits: float = 0.0
    """Trees: decayed tokens the target accepted of them (the planner's calibration, `TreePlans.observe_tree`)."""
    expected: float = 0.0
    """Trees: decayed tokens the drafter expected of them (the sum of the kept nodes' estimates)."""
    rows: tuple[int, Tensor] | None = None
    """This step's hidden rows: (position of the first, [r, E]), until `EagleProposer.commit`; a
    tree step's are its nodes' rows in the tree's order, the root's first."""
    unstored: list[Tensor] | None = field(default_factory=list)
    """Committed positions' rows not yet stored with their block ([r, E] chunks in order, from
    ``stored``; `EagleProposer.store`); None once the sequence stopped drafting."""
    stored: int = 0
    """The first position whose rows are not stored with its block (a block boundary)."""

    @property
    def active(self) -> bool:
        """False once the sequence can never draft again: nothing is kept."""
        return self.cursor.in_step

    def clear(self) -> None:
        """Drop the drafter cache and every kept feature (a preempted sequence is fed again from its recompute)."""
        self.cursor.clear()
        self.rows, self.unstored, self.stored = None, [], 0

    def stop(self) -> None:
        """The sequence never drafts again: its state is freed."""
        self.cursor.stop()
        self.rows = self.unstored = None


def eagle3_refusal(what: str = "an EAGLE-3 drafter") -> str:
    """Why the serving engine refuses an EAGLE-3 drafter, and what runs one instead."""
    return (f"the serving engine runs EAGLE-1 drafters only; {what} reads intermediate target hidden states "
            "its batched forwards do not return. Decode with it through Decoder.generate(method='eagle') "
            "(specops.decoder), or serve an EAGLE-1 drafter (`specops train eagle`)")


class EagleProposer:
    """An EAGLE drafter shared by the engine's ``eagle`` sequences, each with its own `EagleState`."""

    def __init__(self, drafter: Any, device: torch.device, pool: BlockPool | None = None) -> None:
        """``pool``: the target's block pool, whose published blocks' hidden rows are kept for
        later sequences when it caches prefixes (`store`)."""
        if getattr(drafter, "reads_layers", False):
            raise EagleError(eagle3_refusal())
        self.drafter = drafter
        self.device = device  # the target's: q rows go where the verification runs
        self.vocab_size = drafter.config.vocab_size
        self.pool = pool if pool is not None and pool.prefix_caching else None
        self.features: collections.OrderedDict[int, Tensor] = collections.OrderedDict()  # chain hash -> [bs, E]

    def has_features(self, block_hash: int) -> bool:
        """Whether the hidden rows of the published block with this chain hash are kept."""
        return block_hash in self.features

    @property
    def max_context(self) -> int:
        return self.drafter.max_context

    def start(self, seq: Sequence) -> EagleState:
        """The state of a new sequence, its cursor sized to its most tokens and a tree's expanded
        levels: out of step from the start when its prompt leaves no draft room; a greedy one whose
        settings ask for it drafts EAGLE-2 trees (`SpecSettings.eagle_tree`)."""
        spec = seq.spec.eagle_tree() if seq.sampling.greedy else None
        shape = None if spec is None else EagleTree(*spec)
        extra = 0 if shape is None else (shape.depth - 1) * shape.topk
        state = EagleState(cursor=EagleCursor(self.drafter, seq.prompt_len + seq.budget + extra), shape=shape)
        if draft_room(self.max_context, len(seq.tokens)) == 0:
            state.stop()
        return state

    def ready(self, seq: Sequence) -> bool:
        """Whether the sequence can draft now: active, every real entry known, some waiting to be fed."""
        cursor = seq.eagle.cursor
        return cursor.in_step and cursor.unfed > 0 and cursor.known == len(seq.tokens) - 1

    def full_rows(self, seq: Sequence) -> bool:
        """Whether the sequence's target item must return every row (a prefill / recompute of an active one)."""
        return seq.eagle.active and seq.target.computed < len(seq.tokens) - 1

    def observe(self, seq: Sequence, item: FeedItem, out: ItemOutput, drafted: int, tree: bool = False) -> ItemOutput:
        """Keep the step's hidden rows; return the output the verification reads (the item's last
        ``drafted + 1`` rows: a prefill's last row alone; a ``tree``'s every node)."""
        state = seq.eagle
        if not state.active:
            return out
        if out.hidden is None:
            raise RuntimeError("an eagle sequence's forward returned no hidden states")
        if tree:  # the root sits at the pending token's position; `commit` takes the accepted path's rows
            state.rows = (len(seq.tokens) - 1, out.hidden)
            return out
        first = item.kv.computed - len(item.tokens) + item.rows[0]  # the backend advanced kv.computed
        if state.cursor.known < first:  # a prefill after reused cached blocks: their kept rows come first
            self._reuse(seq, first)
        state.rows = (first, out.hidden)
        keep = drafted + 1
        r, h = out.logits.shape[0], out.hidden.shape[0]  # r == keep where the backend skipped the head (`hidden_only`)
        if r == keep and h == keep:
            return out
        return ItemOutput(out.logits[r - keep :], out.hidden[h - keep :], out.step_logits, out.row0 + r - keep)

    def commit(self, seq: Sequence, deadline_passed: bool, path: list[int] | None = None) -> None:
        """After the step's tokens were appended: keep the committed positions' features, or
        free the state for good once the sequence can never draft again. ``path``: a tree step's
        accepted path (node indices, root first): its rows, in path order, are the features of
        the positions the step committed (`EagleProposer.sync`'s feed of the library, which reads
        the rows the target's cache was compacted to)."""
        state = seq.eagle
        if not state.active:
            return
        rows, state.rows = state.rows, None
        if path is not None and rows is not None:
            rows = (rows[0], rows[1][path])  # [len(path), E]: root, then the accepted nodes
        if deadline_passed or draft_room(self.max_context, len(seq.tokens)) == 0:
            state.stop()
            return
        start, want = state.cursor.known, len(seq.tokens) - 1  # entries start .. want - 1 are new
        if want <= start:
            return
        if rows is None or start < rows[0] or want - rows[0] > rows[1].shape[0]:
            # the step's rows do not cover the new entries (a state/forward mismatch): the drafter
            # cannot be made exact again without the missing features, so the sequence decodes plainly
            log.warning("eagle sequence %s lost its drafter state; it decodes plainly", seq.request_id)
            state.stop()
            return
        first, hidden = rows
        # entry i reads (x_{i+1}, f_i); a copy of the rows: a view would keep the step's whole [R, E]
        # hidden states alive while they wait
        kept = hidden[start - first : want - first].clone()
        state.cursor.keep(seq.tokens[start + 1 : want + 1], kept)
        if self.pool is not None and state.unstored is not None:
            state.unstored.append(kept)

    def _reuse(self, seq: Sequence, first: int) -> None:
        """Feed the cursor of a sequence that reused ``first`` positions of cached blocks their kept
        rows (the scheduler matched only blocks whose rows are kept); it stops drafting if they are gone."""
        state, start, rows = seq.eagle, seq.eagle.cursor.known, []
        bs = self.pool.block_size if self.pool is not None else None
        if bs is not None and start % bs == 0 and first % bs == 0:
            for block in seq.target.blocks[start // bs : first // bs]:
                kept = self.features.get(self.pool.block_hash(block))
                if kept is None:
                    break
                rows.append(kept)
        if bs is None or len(rows) * bs != first - start:
            log.warning("eagle sequence %s reused cached blocks without their hidden states; it decodes plainly",
                        seq.request_id)
            state.stop()
            return
        state.cursor.keep(seq.tokens[start + 1 : first + 1], torch.cat(rows))
        state.unstored, state.stored = [], first

    def store(self, seq: Sequence) -> None:
        """Keep the hidden rows of the blocks ``seq`` has published since the last call, by chain
        hash, for later sequences that reuse those blocks (at most one entry per pool block, the
        least recently used dropped first)."""
        state = seq.eagle
        if self.pool is None or state is None or state.unstored is None:
            return
        bs, kv = self.pool.block_size, seq.target
        done = state.stored // bs
        if kv.published <= done:  # most steps: no block published since the last call
            return
        have = sum(r.shape[0] for r in state.unstored)
        if have < bs:
            return
        rows = torch.cat(state.unstored) if len(state.unstored) > 1 else state.unstored[0]
        used = 0
        while done < kv.published and used + bs <= have:
            h = self.pool.block_hash(kv.blocks[done])
            if h is not None:
                if h in self.features:
                    self.features.move_to_end(h)
                else:
                    self.features[h] = rows[used : used + bs].clone()
                    while len(self.features) > self.pool.num_blocks:
                        self.features.popitem(last=False)
            done, used = done + 1, used + bs
        state.stored = done * bs
        state.unstored = [rows[used:]] if used < have else []

    def _threads(self):
        """Where the drafter runs on the CPU: its torch ops on the calling thread (`torch_single_thread`)."""
        dev = self.drafter.fc.weight.device
        return torch_single_thread() if dev.type == "cpu" else contextlib.nullcontext()

    def catch_up(self, seq: Sequence) -> Tensor:
        """Feed a `ready` sequence's waiting entries in one drafter step (`EagleCursor.catch_up`; call
        it under ``torch.no_grad``); the drafter's prediction of the pending token's feature [E]."""
        cursor = seq.eagle.cursor
        cursor.catch_up()
        return cursor.last

    def propose(self, seq: Sequence, gamma: int) -> tuple[list[int], Tensor | None]:
        """γ drafted tokens of a `ready` sequence and their q rows [γ, V] (None when greedy)."""
        with torch.no_grad(), self._threads():
            self.catch_up(seq)
            drafted, q = seq.eagle.cursor.chain(gamma, seq.sampling, seq.generator, self.vocab_size, self.device)
        return drafted, None if q is None else q[0]

    def propose_tree(self, seq: Sequence, depth: int, size: int) -> tuple[DraftTree, list[float], int, bool]:
        """The EAGLE-2 tree (`eagle_tree.draft_tree`) of a `ready` tree sequence: at most ``depth``
        levels (cut to the levels its drafter cache holds) and ``size`` nodes, root included; the
        drafter's estimates of the best nodes of its shape (``draft_tree``'s ``estimates``), the
        drafter forwards run (the feed, then one per level but the last), and whether the tree was
        drafted as deep as its shape (only then do the estimates describe the shape's nodes)."""
        state = seq.eagle
        shape, cursor = state.shape, state.cursor
        with torch.no_grad(), self._threads():
            self.catch_up(seq)
            depth = cursor.depth_room(depth, shape.topk)
            estimates: list[float] = []
            tree, forwards = cursor.tree(shape, depth, min(size, shape.tree_size), seq.tokens[-1], self.device,
                                         estimates)
        return tree, estimates, forwards + 1, depth == shape.depth

    def release(self, seq: Sequence) -> None:
        """Drop a finished, aborted or preempted sequence's drafter cache and kept features (a
        preempted one is rebuilt from its recompute)."""
        if seq.eagle is not None:
            seq.eagle.clear()
