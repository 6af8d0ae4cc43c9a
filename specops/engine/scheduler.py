"""Which sequences run in the next step, and their KV blocks: admission, lookahead, preemption.

Per step (`Scheduler.schedule`):

1. running sequences first, oldest first: each must hold blocks for every committed
   token (``len(tokens)`` slots: the pending token's KV is written this step). When the
   pool is empty the *newest* running sequence is preempted — its blocks are freed and
   it goes back to the head of the waiting queue, to be recomputed from its committed
   tokens later — until the older one fits. The pool can never be over-committed.
2. waiting sequences join (FIFO) while the batch has room (``max_batch``), the step's
   token budget allows their prefill (``max_step_tokens``) and the pool can hold all
   their tokens plus one spare block per running sequence (so the next decode steps do
   not immediately preempt what was just admitted). A request whose prompt shares full
   blocks with one admitted in the same step, not yet in the prefix cache, waits a step
   and then reuses them rather than computing them twice (`_shares_uncached`; an EAGLE
   sequence waits so only for another EAGLE sequence's blocks). An EAGLE sequence
   that still drafts reuses only cached blocks whose target hidden states are kept beside them
   (`Sequence.needs_all_hidden`: its drafter reads the hidden state of every token; ``features``,
   the engine's `EagleProposer.has_features`); past the first block without them it computes
   the rest itself.
3. later, once the planner has chosen each sequence's speculation, `grant` allocates the
   *lookahead* slots of its drafts (target, and the draft model's own cache) before the
   forward: all of them or, if that fails, fewer drafts — never a partial allocation.

This is nano-vllm's and vLLM v1's policy (running first, preempt newest, recompute)
with a speculative step being a (γ+1)-token extend.
"""

from __future__ import annotations

import collections
from typing import Callable

from specops.engine.kv_pool import BlockPool
from specops.engine.sequence import Sequence, SeqStatus


class Scheduler:
    """Waiting and running queues over one target pool (and an optional draft pool)."""

    def __init__(self, pool: BlockPool, *, max_batch: int, max_step_tokens: int,
                 draft_pool: BlockPool | None = None,
                 release: Callable[[Sequence], None] | None = None,
                 features: Callable[[int], bool] | None = None) -> None:
        self.pool = pool
        self._features = features  # whether a published block's hidden states are kept (by chain hash)
        self.draft_pool = draft_pool
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.deferrals = 0  # admissions put off a step to reuse a same-step prompt's blocks
        self._release = release  # frees a sequence's blocks (and generic caches) in every model

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self._release is not None:
            self._release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> list[Sequence]:
        """The sequences of the next forward; each holds blocks for all its committed tokens."""
        batch: list[Sequence] = []
        tokens = 0
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:  # preempted by an older one in this loop
                continue
            while not self.pool.grow(seq.target.blocks, len(seq.tokens)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                batch.append(seq)
                tokens += len(seq.tokens) - seq.target.computed
        admitted: list[Sequence] = []
        while self.waiting and len(batch) < self.max_batch:
            seq = self.waiting[0]
            kv = seq.target
            need = len(seq.tokens)
            hidden = seq.needs_all_hidden  # an EAGLE sequence: only blocks whose hidden states are kept
            if not kv.blocks and (not hidden or self._features is not None):  # reuse cached prompt blocks,
                # never the one holding the last token
                kv.computed = kv.published = self.pool.match(kv.blocks, seq.tokens, (need - 1) // self.pool.block_size,
                                                             self._features if hidden else None)
                kv.computed *= self.pool.block_size
            if batch and tokens + need - kv.computed > self.max_step_tokens:
                self._unmatch(seq)
                break
            if self._shares_uncached(seq, admitted):
                self._unmatch(seq)
                self.deferrals += 1
                break
            reserve = len(self.running)
            if self.pool.missing(kv.blocks, need) + reserve > self.pool.num_free and (
                self.running or not self.pool.can_grow(kv.blocks, need)
            ):
                self._unmatch(seq)
                break  # wait for memory; a lone request always fits (max_model_len <= capacity)
            self.pool.grow(kv.blocks, need)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
            admitted.append(seq)
            tokens += need - seq.target.computed
        return batch

    def _shares_uncached(self, seq: Sequence, admitted: list[Sequence]) -> bool:
        """Whether a request admitted in this same step computes full prompt blocks that ``seq``
        could reuse but has not found in the cache: both would compute them in this forward,
        while one step later the other's blocks are published (at its commit) and ``seq``
        reuses them. The queue then waits a step (FIFO is kept): ``seq``'s first token comes a
        step later, from a shorter prefill. In-process, 128 of `bench serve`'s prompts from a
        cold cache at 16 streams recomputed 53 of 708 cacheable prompt blocks without this, none
        with it. Never twice for one cause: the other request is running by the next step. An
        EAGLE sequence that drafts waits only for another such sequence: the blocks it may reuse
        are those published with their hidden rows, which only such a sequence keeps."""
        if not self.pool.prefix_caching or not admitted:
            return False
        hidden = seq.needs_all_hidden
        bs = self.pool.block_size
        reusable = (len(seq.tokens) - 1) // bs * bs  # never the block holding the last token
        have = seq.target.computed
        if reusable <= have:
            return False
        head = seq.tokens[have : have + bs]  # the first block it would compute
        for other in admitted:
            if hidden and not other.needs_all_hidden:
                continue
            if other.target.computed <= have and other.tokens[have : have + bs] == head \
                    and len(other.tokens) >= have + bs and other.tokens[:have] == seq.tokens[:have]:
                return True
        return False

    def _unmatch(self, seq: Sequence) -> None:
        """Undo a prefix-cache match of a sequence that stays waiting."""
        if seq.target.blocks and seq.target.computed == seq.target.published * self.pool.block_size:
            self.pool.release(seq.target.blocks)
            seq.target.computed = seq.target.published = 0

    def grant(self, seq: Sequence, extra: int, draft_extra: int | None = None) -> bool:
        """Allocate lookahead for ``extra`` speculative target slots after the committed tokens
        (and ``draft_extra`` draft-model slots when given): all of it, or nothing."""
        target_slots = len(seq.tokens) + extra
        if not self.pool.can_grow(seq.target.blocks, target_slots):
            return False
        if draft_extra is not None:
            if self.draft_pool is None:
                raise ValueError("no draft pool to grant draft slots from")
            draft_slots = len(seq.tokens) + draft_extra
            if not self.draft_pool.grow(seq.draft.blocks, draft_slots):
                return False
        return self.pool.grow(seq.target.blocks, target_slots)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        self.remove(seq)
        if self._release is not None:
            self._release(seq)
        seq.status = SeqStatus.FINISHED
