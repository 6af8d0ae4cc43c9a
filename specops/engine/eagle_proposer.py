"""EAGLE feature drafting in the serving engine: one drafter cache per sequence.

The drafter (`specops.decoder.eagle_model.EagleDrafter`, the model `Decoder(eagle=...)`
loaded) is shared; each sequence keeps its own `EagleState`: a KV cache of the drafter's
one layer (`EagleDrafter.new_cache`, sized to the sequence's most tokens and allocated at
its first drafting) and the target's hidden states of its positions the cache has not
been fed yet. The drafting runs `specops.decoder.eagle.draft_chain` on that cache, so a
sequence proposes what `Decoder.generate(method="eagle")` proposes from the same state.

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
* `propose` first feeds the unfed entries in one drafter step (its last output predicts
  the pending token's feature), then drafts the chain, then cuts the cache back to the real
  entries: the drafted entries rest on predicted features and are never kept.

A preempted sequence loses its drafter state with its target blocks (`release`) and is
rebuilt from its recompute's hidden rows. A sequence stops drafting for good once it outgrows
the drafter's context (`draft_room`, ``fallback_reason`` "draft_context", its state freed
at that commit), or past its deadline; it then decodes plainly, and its later (re)admissions may
reuse cached prompt blocks. Greedy verification makes the output the target's whatever the
drafter proposes; sampled drafts hand their q rows to `speculation.judge_block`.

The drafter runs sequence by sequence (its chain is γ one-token steps per sequence); the
planner charges it as a per-sequence overhead measured from the engine's own steps, as it
does n-gram lookups and Medusa trees. The per-sequence caches live outside the paged KV
budget (one layer: ``2 * kv_heads * head_dim`` values per token of the sequence).

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
from specops.decoder.speculation import draft_room
from specops.engine.batch_forward import FeedItem, ItemOutput
from specops.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EagleState:
    """One sequence's drafter state (see the module docstring)."""

    active: bool = True
    """False once the sequence can never draft again (outgrew the drafter, deadline): nothing is kept."""
    cache: Any = None
    """The drafter's KV cache of this sequence (`EagleDrafter.new_cache`); None until the first drafting."""
    features: list[Tensor] = field(default_factory=list)
    """Target hidden rows [k, E] of the entries after the cache's, in order, not yet fed."""
    unfed: int = 0
    """Rows in ``features``."""
    rows: tuple[int, Tensor] | None = None
    """This step's hidden rows: (position of the first, [r, E]), until `EagleProposer.commit`."""

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
        """The state of a new sequence: inactive from the start when its prompt leaves no draft room."""
        return EagleState(active=draft_room(self.max_context, len(seq.tokens)) > 0)

    def ready(self, seq: Sequence) -> bool:
        """Whether the sequence can draft now: active, every real entry known."""
        state = seq.eagle
        return state.active and state.unfed > 0 and state.known == len(seq.tokens) - 1

    def full_rows(self, seq: Sequence) -> bool:
        """Whether the sequence's target item must return every row (a prefill / recompute of an active one)."""
        return seq.eagle.active and seq.target.computed < len(seq.tokens) - 1

    def observe(self, seq: Sequence, item: FeedItem, out: ItemOutput, drafted: int) -> ItemOutput:
        """Keep the step's hidden rows; return the output the verification reads (the item's last
        ``drafted + 1`` rows: a prefill's last row alone)."""
        state = seq.eagle
        if not state.active:
            return out
        if out.hidden is None:
            raise RuntimeError("an eagle sequence's forward returned no hidden states")
        first = item.kv.computed - len(item.tokens) + item.rows[0]  # the backend advanced kv.computed
        state.rows = (first, out.hidden)
        keep = drafted + 1
        r, h = out.logits.shape[0], out.hidden.shape[0]  # r == keep where the backend skipped the head (`hidden_only`)
        if r == keep and h == keep:
            return out
        return ItemOutput(out.logits[r - keep :], out.hidden[h - keep :], out.step_logits, out.row0 + r - keep)

    def commit(self, seq: Sequence, deadline_passed: bool) -> None:
        """After the step's tokens were appended: keep the committed positions' features, or
        free the state for good once the sequence can never draft again."""
        state = seq.eagle
        if not state.active:
            return
        rows, state.rows = state.rows, None
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

    def propose(self, seq: Sequence, gamma: int) -> tuple[list[int], Tensor | None]:
        """γ drafted tokens of a `ready` sequence and their q rows [γ, V] (None when greedy)."""
        drafter = self.drafter
        dev = drafter.fc.weight.device
        state = seq.eagle
        with torch.no_grad(), torch_single_thread() if dev.type == "cpu" else contextlib.nullcontext():
            if state.cache is None:
                state.cache = drafter.new_cache(seq.prompt_len + seq.budget)
            fed = state.cache.length
            tokens = torch.tensor(seq.tokens[fed + 1 : fed + 1 + state.unfed], dtype=torch.long, device=dev)
            features = state.features[0] if len(state.features) == 1 else torch.cat(state.features)
            last = drafter.step(tokens, features.to(dev), state.cache)[-1]  # predicts the pending token's feature
            state.features, state.unfed = [], 0
            real = state.cache.length
            drafted, q = draft_chain(drafter, last, gamma, seq.sampling, seq.generator, self.vocab_size,
                                      self.device, state.cache)
            state.cache.truncate(real)  # the drafted entries rest on predicted features
        return drafted, None if q is None else q[0]

    def release(self, seq: Sequence) -> None:
        """Drop a finished, aborted or preempted sequence's drafter cache and features (a preempted
        one is rebuilt from its recompute)."""
        if seq.eagle is not None:
            seq.eagle.clear()
