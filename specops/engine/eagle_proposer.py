"""EAGLE feature drafting in the serving engine: one drafter cache per sequence.

The drafter (`specops.decoder.eagle_model.EagleDrafter`, the model `Decoder(eagle=...)`
loaded) is shared; each sequence keeps its own `EagleState`: a KV cache of the drafter's
one layer (`EagleDrafter.new_cache`, sized to the sequence's most tokens and allocated at
its first drafting) and the target's hidden states of its positions the cache has not
been fed yet. The drafting runs `specops.decoder.eagle.draft_chain` on that cache, or, for a
greedy request whose settings ask for one (`SpecSettings.eagle_tree`), EAGLE-2's dynamic tree
`specops.decoder.eagle_tree.draft_tree`, so a sequence proposes what
`Decoder.generate(method="eagle")` (``eagle_tree=``) proposes from the same state.

Cache bookkeeping (as in `specops.decoder.eagle`): for a sequence ``x_0 .. x_{N-1}`` with
``x_{N-1}`` pending in the target, the drafter's entry ``i`` reads ``(x_{i+1}, f_i)``, and
entries ``0 .. N-2`` are real. The engine feeds them lazily:

* every target forward of an active sequence returns its hidden rows (the forward asks for
  hidden states whenever one is in the batch); `observe` keeps them and `commit` appends the
  rows of the positions the step committed (pending token, accepted drafts) to the
  sequence's unfed features — on a plain step one row, on a speculative one the accepted
  prefix's, so a step the planner declined costs no drafter forward;
* a prefill or a recompute (after preemption) feeds the whole sequence, and its item asks
  for the hidden states of every row and the logits of the last (`FeedItem.hidden_only`: the
  C stack skips the LM head for the others); `observe` keeps the hidden rows and hands the
  verification only the last row. An active sequence never reuses cached prompt
  blocks (`Sequence.needs_all_hidden`): their hidden states were never computed here;
* `propose` / `propose_tree` first feed the unfed entries in one drafter step (`catch_up`: its
  last output predicts the pending token's feature), then draft the chain or the tree, then cut
  the cache back to the real entries: the drafted entries rest on predicted features and are
  never kept;
* a tree is verified as a Medusa tree is (the engine's batched forward with its tree mask,
  `tree_verify.judge_tree`, the target's cache compacted to the accepted path). Its item returns
  every node's hidden row; `commit` keeps the rows of the accepted path, root first, in path order
  (tree rows, not a block of positions): the features of the positions the step committed, as the
  library's `EagleProposer.sync` feeds them after a tree step.

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

The engine runs EAGLE-1 drafters: an EAGLE-3 drafter (`specops.decoder.eagle3_model`) reads
intermediate target hidden states its batched forwards do not return, and is refused when the
engine is built (``specops serve --eagle PATH`` refuses such a folder before loading anything).
"""

from __future__ import annotations

import contextlib

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specops.decoder.eagle import draft_chain, torch_single_thread
from specops.decoder.eagle_model import EagleError
from specops.decoder.eagle_tree import EagleTree, draft_tree
from specops.decoder.speculation import draft_room
from specops.decoder.step import DraftTree
from specops.engine.batch_forward import FeedItem, ItemOutput
from specops.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EagleState:
    """One sequence's drafter state (see the module docstring)."""

    active: bool = True
    """False once the sequence can never draft again (outgrew the drafter, deadline): nothing is kept."""
    shape: EagleTree | None = None
    """The EAGLE-2 tree a greedy request drafts each step (`SpecSettings.eagle_tree`); None: the chain."""
    hits: float = 0.0
    """Trees: decayed tokens the target accepted of them (the planner's calibration, `TreePlans.observe_tree`)."""
    expected: float = 0.0
    """Trees: decayed tokens the drafter expected of them (the sum of the kept nodes' estimates)."""
    cache: Any = None
    """The drafter's KV cache of this sequence (`EagleDrafter.new_cache`); None until the first drafting."""
    features: list[Tensor] = field(default_factory=list)
    """Target hidden rows [k, E] of the entries after the cache's, in order, not yet fed."""
    unfed: int = 0
    """Rows in ``features``."""
    rows: tuple[int, Tensor] | None = None
    """This step's hidden rows: (position of the first, [r, E]), until `EagleProposer.commit`; a
    tree step's are its nodes' rows in the tree's order, the root's first."""

    @property
    def known(self) -> int:
        """Entries whose features are in the cache or in ``features``."""
        return (0 if self.cache is None else self.cache.length) + self.unfed

    def clear(self) -> None:
        self.cache, self.features, self.unfed, self.rows = None, [], 0, None


def eagle3_refusal(what: str = "an EAGLE-3 drafter") -> str:
    """Why the serving engine refuses an EAGLE-3 drafter, and what runs one instead."""
    return (f"the serving engine runs EAGLE-1 drafters only; {what} reads intermediate target hidden states "
            "its batched forwards do not return. Decode with it through Decoder.generate(method='eagle') "
            "(specops.decoder), or serve an EAGLE-1 drafter (`specops train eagle`)")


class EagleProposer:
    """An EAGLE drafter shared by the engine's ``eagle`` sequences, each with its own `EagleState`."""

    def __init__(self, drafter: Any, device: torch.device) -> None:
        if getattr(drafter, "reads_layers", False):
            raise EagleError(eagle3_refusal())
        self.drafter = drafter
        self.device = device  # the target's: q rows go where the verification runs
        self.vocab_size = drafter.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.drafter.max_context

    def start(self, seq: Sequence) -> EagleState:
        """The state of a new sequence: inactive from the start when its prompt leaves no draft room;
        a greedy one whose settings ask for it drafts EAGLE-2 trees (`SpecSettings.eagle_tree`)."""
        shape = seq.spec.eagle_tree() if seq.sampling.greedy else None
        return EagleState(active=draft_room(self.max_context, len(seq.tokens)) > 0,
                          shape=None if shape is None else EagleTree(*shape))

    def ready(self, seq: Sequence) -> bool:
        """Whether the sequence can draft now: active, every real entry known."""
        state = seq.eagle
        return state.active and state.unfed > 0 and state.known == len(seq.tokens) - 1

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
            state.clear()
            state.active = False
            return
        start, want = state.known, len(seq.tokens) - 1  # entries start .. want - 1 are new
        if want <= start:
            return
        if rows is None or start < rows[0] or want - rows[0] > rows[1].shape[0]:
            # the step's rows do not cover the new entries (a state/forward mismatch): the drafter
            # cannot be made exact again without the missing features, so the sequence decodes plainly
            log.warning("eagle sequence %s lost its drafter state; it decodes plainly", seq.request_id)
            state.clear()
            state.active = False
            return
        first, hidden = rows
        # a copy: a view would keep the step's whole [R, E] hidden states alive while the rows wait
        state.features.append(hidden[start - first : want - first].clone())
        state.unfed += want - start

    def _threads(self):
        """Where the drafter runs on the CPU: its torch ops on the calling thread (`torch_single_thread`)."""
        dev = self.drafter.fc.weight.device
        return torch_single_thread() if dev.type == "cpu" else contextlib.nullcontext()

    def catch_up(self, seq: Sequence) -> Tensor:
        """Feed a `ready` sequence's unfed entries in one drafter step (call it under
        ``torch.no_grad``); its output at the last one, the drafter's prediction of the pending
        token's feature [E]. The cache (allocated here at first) holds the sequence's most tokens,
        and a tree's expanded levels beyond them."""
        drafter, state = self.drafter, seq.eagle
        dev = drafter.fc.weight.device
        if state.cache is None:
            shape = state.shape
            extra = 0 if shape is None else (shape.depth - 1) * shape.topk
            state.cache = drafter.new_cache(seq.prompt_len + seq.budget + extra)
        fed = state.cache.length
        tokens = torch.tensor(seq.tokens[fed + 1 : fed + 1 + state.unfed], dtype=torch.long, device=dev)
        features = state.features[0] if len(state.features) == 1 else torch.cat(state.features)
        state.features, state.unfed = [], 0
        return drafter.step(tokens, features.to(dev), state.cache)[-1]

    def propose(self, seq: Sequence, gamma: int) -> tuple[list[int], Tensor | None]:
        """γ drafted tokens of a `ready` sequence and their q rows [γ, V] (None when greedy)."""
        state = seq.eagle
        with torch.no_grad(), self._threads():
            last = self.catch_up(seq)
            real = state.cache.length
            drafted, q = draft_chain(self.drafter, last, gamma, seq.sampling, seq.generator, self.vocab_size,
                                      self.device, state.cache)
            state.cache.truncate(real)  # the drafted entries rest on predicted features
        return drafted, None if q is None else q[0]

    def propose_tree(self, seq: Sequence, depth: int, size: int) -> tuple[DraftTree, list[float], int, bool]:
        """The EAGLE-2 tree (`eagle_tree.draft_tree`) of a `ready` tree sequence: at most ``depth``
        levels (cut to the levels its drafter cache holds) and ``size`` nodes, root included; the
        drafter's estimates of the best nodes of its shape (``draft_tree``'s ``estimates``), the
        drafter forwards run (the feed, then one per level but the last), and whether the tree was
        drafted as deep as its shape (only then do the estimates describe the shape's nodes)."""
        state = seq.eagle
        shape = state.shape
        with torch.no_grad(), self._threads():
            last = self.catch_up(seq)
            real = state.cache.length
            depth = min(depth, 1 + (state.cache.max_len - real) // shape.topk)
            estimates: list[float] = []
            tree, forwards = draft_tree(self.drafter, last, seq.tokens[-1], shape, depth, min(size, shape.tree_size),
                                        self.device, state.cache, estimates)
            state.cache.truncate(real)  # the expanded nodes rest on predicted features
        return tree, estimates, forwards + 1, depth == shape.depth

    def release(self, seq: Sequence) -> None:
        """Drop a finished, aborted or preempted sequence's drafter cache and features (a preempted
        one is rebuilt from its recompute)."""
        if seq.eagle is not None:
            seq.eagle.clear()
