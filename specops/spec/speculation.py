"""The target side of one speculative decoding request: prefill, verify a block, roll back.

Both drafters that propose a linear block of tokens (a draft model, `draft.py`; n-gram
lookup, `ngram.py`) share this bookkeeping, so they differ only in how they draft.

Cache invariant: the target's KV cache holds every token of the sequence except the
last one, the *pending* token. A verification step runs one target forward over
``[pending, d_1 .. d_G]`` (G + 1 positions, nothing of the prefix recomputed), which
gives the target distributions for ``d_1 .. d_G`` and for the token after ``d_G``.
After ``n`` tokens are accepted and a recovered/bonus token ``x`` follows, the cache is
cut back to ``[prefix, pending, d_1 .. d_n]`` and ``x`` becomes the new pending token.

Edge cases are exact by construction:

* everything accepted: nothing is rolled back, ``x`` is the bonus token;
* rejection at the last position: the cache drops only ``d_G``;
* EOS inside the accepted block (or as ``x``): tokens after the first EOS are dropped
  and decoding stops;
* ``max_new_tokens``: a step never drafts more than ``remaining - 1`` tokens, so the
  budget can land anywhere inside a block and the output still ends exactly there;
* the context window: the same clamp keeps ``prompt + output <= max_context``.

Decode deadline (timeout protection): once ``deadline_s`` seconds have passed since
the request started, every further step drafts nothing, i.e. decoding continues as
plain one-token target steps on the same cache, and the stats say
``fallback_reason == "deadline"``. Worst-case latency is then bounded by plain decoding.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specops.spec.clock import device_clock
from specops.spec.request import check_deadline, check_room, eos_cut, eos_set, stop_reason
from specops.models.runner import ModelRunner, prompt_forward
from specops.spec.sampling import SamplingConfig, next_token
from specops.spec.stats import DecodeStats
from specops.spec.tree import TreeBuffers
from specops.spec.tree_verify import TypicalAcceptance, judge_tree
from specops.spec.verify import accept_greedy, verify_block_sampled
from specops.kernels import cpu_linear


@dataclass
class StepResult:
    """What one verification step produced."""

    drafted: int  # drafted tokens counted (after an EOS cut)
    accepted: int  # accepted tokens counted (after an EOS cut)
    emitted: list[int]  # tokens appended to the output
    raw_accepted: int  # verifier's accepted count before any cut (for γ schedules)


def step_tokens(accepted: list[int], next_token: int, drafted: int, eos: frozenset[int]) -> StepResult:
    """The one commit rule of a verified step, for `Decoder.generate` and the serving engine
    alike: the ``accepted`` drafts, then the recovered or bonus ``next_token``, cut after the
    first EOS. An EOS among the accepted drafts voids the positions after it: the step counts
    as that many drafted and accepted. ``drafted``: tokens speculated (a block's G, a tree's
    depth); ``eos``: empty never stops."""
    n = len(accepted)
    new = eos_cut([*accepted, next_token], eos)
    if len(new) <= n:  # EOS was an accepted draft token: the rest of the block is void
        return StepResult(drafted=len(new), accepted=len(new), emitted=new, raw_accepted=n)
    return StepResult(drafted=drafted, accepted=n, emitted=new, raw_accepted=n)


def judge_block(logits: torch.Tensor, drafted: list[int], q: torch.Tensor | None, sampling: SamplingConfig,
                generator: torch.Generator, choice: list[int] | None = None) -> tuple[int, int]:
    """The one acceptance rule of a linear block, for `Decoder.generate` and the serving engine
    alike: (accepted count n, next token) from the target's ``logits`` [G+1, V] over
    ``[pending, d_1 .. d_G]``. Greedy: drafts are kept while they equal the target's argmax
    (``choice``, the rows' argmax where the forward computed it), which then follows; sampled with
    nothing drafted: the next token drawn from the target's row (a plain step, the same draws);
    sampled: rejection sampling against the drafter's q [G, V] (None: a deterministic drafter,
    a point mass)."""
    if sampling.greedy:  # g == 0 too: the argmax is the next token itself
        return accept_greedy(drafted, cpu_linear.argmax(logits).tolist() if choice is None else choice)
    if not drafted:
        return 0, int(next_token(logits[None, 0], sampling, generator)[0])
    return verify_block_sampled(logits, drafted, q, sampling, generator)


DRAFT_CONTEXT = "draft_context"
"""``fallback_reason`` of a draft-model request whose draft ran out of context: its drafting
stops there and the rest decodes plainly (the target's context still bounds the request)."""


def draft_room(draft_context: int, sequence_len: int) -> int:
    """Tokens a draft model with ``draft_context`` positions can draft after a sequence of
    ``sequence_len`` tokens: it holds every token but the pending one, then feeds the pending
    token and all drafts but the last (0 when the sequence has outgrown it)."""
    return max(0, draft_context - sequence_len + 1)


class TargetVerifier:
    """Holds the sequence and the target runner of one request and verifies drafted blocks."""

    def __init__(
        self,
        target: ModelRunner,
        prompt: list[int],
        *,
        sampling: SamplingConfig,
        generator: torch.Generator,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None,
        stats: DecodeStats,
        context_limit: int | None = None,
        deadline_s: float | None = None,
        keep_hidden: bool = False,
        keep_features: bool | tuple[int, ...] = False,
        typical: TypicalAcceptance | None = None,
    ) -> None:
        """``keep_hidden``: keep the target's last hidden state after every forward (``hidden``),
        for a Medusa step that follows (`specops.spec.auto`). ``keep_features``: keep the hidden
        states of every position a forward settled (``features``): the prompt's cached tokens after
        `prefill`, ``[pending, d_1 .. d_n]`` after `verify`, which an EAGLE drafter reads next;
        True: the last hidden state (EAGLE-1), a tuple of ``hidden_states`` indices: those layers'
        side by side (an EAGLE-3 drafter's `feature_layers`; a `runner.returns_layers` target).
        ``typical``: sampled trees walk by this LOSSY rule instead of exact rejection sampling
        (`verify_tree`; a Medusa request that asked for it)."""
        self.target = target
        self.sampling = sampling
        self.generator = generator
        self.stats = stats
        self.eos = eos_set(eos_token_id)
        self.tokens: list[int] = list(prompt)  # the whole sequence: prompt + output
        self.prompt_len = len(prompt)
        self.output: list[int] = []
        limit = target.max_context if context_limit is None else min(target.max_context, context_limit)
        self.budget = check_room(self.prompt_len, limit, max_new_tokens)
        self.max_new_tokens = max_new_tokens
        self.stopped_by_eos = False
        self.device = target.device
        self.deadline = None if deadline_s is None else time.perf_counter() + check_deadline(deadline_s)
        self.keep_hidden = keep_hidden
        self.typical = typical
        self.feature_layers = None if isinstance(keep_features, bool) else tuple(keep_features)
        self.keep_features = bool(keep_features)
        self._feature_rows: torch.Tensor | None = None  # [n, E | k*E] (keep_features): the last forward's settled positions
        self._features_at = -1  # the target forward (its count in stats before it) that set them
        self._hidden: torch.Tensor | None = None  # [E] target hidden state at the last cached position (keep_hidden)
        self._hidden_source: Callable[[], torch.Tensor] | None = None  # reads it on demand (`hidden_from`)
        # greedy blocks verified in one C call where the runner has it (`FastLlamaRunner.block_verifier`)
        make = getattr(target, "block_verifier", None) if sampling.greedy and self.feature_layers is None else None
        self.block = make() if make is not None else None

    # -- state -----------------------------------------------------------------------
    @property
    def features(self) -> torch.Tensor | None:
        """The hidden states (``keep_features``) of the positions the last forward that kept them
        settled: the prompt but its last token after the prefill, then per step the pending token
        and the accepted drafts (a tree: its root and accepted path)."""
        return self._feature_rows

    @features.setter
    def features(self, value: torch.Tensor | None) -> None:
        self._feature_rows, self._features_at = value, self.stats.target_forwards

    @property
    def features_fresh(self) -> bool:
        """Whether `features` come from the latest target forward (a one-call step that commits
        without them leaves the previous step's in place)."""
        return self._feature_rows is not None and self._features_at == self.stats.target_forwards - 1

    @property
    def hidden(self) -> torch.Tensor | None:
        """[E] the target's hidden state at the last cached position (``keep_hidden``), read from
        its source (`hidden_from`) on first use."""
        if self._hidden_source is not None:
            self._hidden, self._hidden_source = self._hidden_source(), None
        return self._hidden

    @hidden.setter
    def hidden(self, value: torch.Tensor | None) -> None:
        self._hidden, self._hidden_source = value, None

    def hidden_from(self, source: Callable[[], torch.Tensor]) -> None:
        """The hidden state is what ``source`` returns, read only if a step asks for it: a C step
        loop's buffer holds it until that loop's next step, and most steps after one never read it
        (in `auto`, 1 step in ~40 on the mixed suite; a copy each step was ~4% of a draft step)."""
        self._hidden, self._hidden_source = None, source

    @property
    def has_hidden(self) -> bool:
        """Whether `hidden` is known (without reading it)."""
        return self._hidden is not None or self._hidden_source is not None

    @property
    def done(self) -> bool:
        return self.stopped_by_eos or len(self.output) >= self.budget

    @property
    def remaining(self) -> int:
        return self.budget - len(self.output)

    def max_draft(self) -> int:
        """The most tokens the next block may draft (budget and context clamp; 0 past the deadline)."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.stats.fallback_reason = "deadline"
            return 0
        return max(self.remaining - 1, 0)

    def stop_reason(self) -> str:
        return stop_reason(self.stopped_by_eos, self.budget, self.max_new_tokens)

    # -- steps -----------------------------------------------------------------------
    def prefill(self) -> None:
        """Run the prompt except its last token through the target (nothing when it is 1 token)."""
        self.target.reset(1)
        if self.prompt_len > 1:
            t0 = device_clock(self.device)
            ids = torch.tensor([self.tokens[:-1]], dtype=torch.long, device=self.device)  # [1, P-1]
            out = prompt_forward(self.target, ids, logits=False, need_hidden=self._need_hidden(),
                                 hidden_layers=self.feature_layers)
            if self.keep_hidden:
                self.hidden = out.hidden[0, -1]  # [E]
            if self.keep_features:
                self.features = self._features(out)[0]  # [P-1, E] or [P-1, k*E]
            dt = device_clock(self.device) - t0
            self.stats.target_forwards += 1
            self.stats.verify_s += dt
            self.stats.prefill_s += dt

    def verify(
        self,
        drafted: list[int],
        draft_probs: torch.Tensor | None = None,  # [1, G, V] filtered draft distributions; None = deterministic drafter
    ) -> StepResult:
        """Verify ``drafted`` (G >= 0 tokens) in one target forward and advance the sequence."""
        g = len(drafted)
        limit = self.max_draft()
        if g > limit:
            if self.deadline is None or time.perf_counter() <= self.deadline:
                raise ValueError(f"block of {g} drafted tokens exceeds the {limit} the budget allows")
            # the deadline passed while the block was drafted: this step runs plainly (dropping
            # a drafted block is lossless), whichever drafter called (draft, auto, async pipeline)
            drafted, draft_probs, g = [], None, 0
        t0 = device_clock(self.device)
        if self.block is not None and self.block.applies(g + 1):  # the same forward and count, one C call
            n, nxt = self.block.verify([self.tokens[-1], *drafted])
            if self.keep_hidden:  # the loop's buffer holds it until the block verifier's next call (`verify`)
                self.hidden_from(functools.partial(self.block.hidden, g + 1, n))  # [E]
            if self.keep_features:
                self.features = torch.stack([self.block.hidden(g + 1, i) for i in range(n + 1)])  # [n+1, E]
            return self._finish(drafted, n, nxt, g, t0)
        block = torch.tensor([[self.tokens[-1], *drafted]], dtype=torch.long, device=self.device)  # [1, G+1]
        layers = {} if self.feature_layers is None else {"hidden_layers": self.feature_layers}
        out = self.target.forward(block, need_hidden=self._need_hidden(), **layers)
        n, nxt = judge_block(out.logits[0], drafted, None if draft_probs is None else draft_probs[0], self.sampling,
                             self.generator, out.choices() if self.sampling.greedy else None)
        if self.keep_hidden:
            self.hidden = out.hidden[0, n]  # [E] at d_n, whose logits chose the next token
        if self.keep_features:
            self.features = self._features(out)[0, : n + 1]  # [n+1, E or k*E]: pending, d_1 .. d_n
        return self._finish(drafted, n, nxt, g, t0)

    def verify_tree(self, tokens: torch.Tensor, buffers: TreeBuffers,  # tokens: [N] long
                    drafted: int | None = None) -> StepResult:
        """Verify a drafted tree in one target forward and advance the sequence along its accepted path.

        ``tokens``: the nodes' tokens in ``buffers``' order, the root first, which is the pending
        token. The forward sees the cache and each node's ancestors (``buffers.attn_mask``) at
        positions ``cache_len + depth``; `tree_verify.judge_tree` walks it (greedy: the longest
        path of target argmaxes; sampled: recursive rejection sampling with the nodes as point
        masses); the cache keeps the root and the accepted nodes (`compact`), and ``features`` /
        ``hidden`` are read along that path, as `verify` leaves them after a block. The step
        counts the tree's depth as drafted (Medusa's tree steps count the same way). Past the
        deadline the step runs plainly, as `verify` does with a block drafted meanwhile.
        ``drafted``: the positions the step drafted where not the tree's depth (a merged
        prompt-lookup branch may reach deeper). Sampled trees walk by ``typical`` acceptance
        where the request asked for that LOSSY rule."""
        n, depth = buffers.num_nodes, buffers.spec.depth if drafted is None else drafted
        if tuple(tokens.shape) != (n,):
            raise ValueError(f"tree tokens must be [N] = [{n}], got {tuple(tokens.shape)}")
        if int(tokens[0]) != self.tokens[-1]:
            raise ValueError(f"a tree's root must be the pending token {self.tokens[-1]}, got {int(tokens[0])}")
        start, limit = self.target.cache_len, self.max_draft()
        if depth > limit and self.deadline is not None and time.perf_counter() > self.deadline:
            return self.verify([])  # the deadline passed while the tree was drafted: this step runs plainly
        if depth > limit or start + n > self.target.max_context:
            raise ValueError(f"a tree of {n} nodes, {depth} deep, exceeds what the budget ({limit} drafts) "
                             f"or the context ({self.target.max_context - start} positions) allows")
        t0 = device_clock(self.device)
        layers = {} if self.feature_layers is None else {"hidden_layers": self.feature_layers}
        tokens = tokens.to(self.device)
        out = self.target.forward(tokens[None], position_ids=(start + buffers.depth.to(self.device))[None],
                                  tree_mask=buffers.attn_mask, need_hidden=self._need_hidden(), **layers)
        verdict = judge_tree(tokens, out.logits[0], buffers, self.sampling, self.generator, self.typical,
                             choice=out.argmax if self.sampling.greedy else None)
        path = verdict.path
        self.target.compact(start, path)  # [.., pending, accepted nodes]
        if self.keep_hidden:
            self.hidden = out.hidden[0, path[-1]]  # [E] at the last accepted node, whose logits chose the next token
        if self.keep_features:
            self.features = self._features(out)[0, path]  # [n+1, E or k*E]: the root, then the accepted nodes
        step = self.commit(tokens[path[1:]].tolist(), verdict.next_token, drafted=depth)
        self.stats.verify_s += device_clock(self.device) - t0
        self.stats.target_forwards += 1
        return step

    def _need_hidden(self) -> bool:
        return self.keep_hidden or (self.keep_features and self.feature_layers is None)

    def _features(self, out) -> torch.Tensor:  # [B, T, E] or [B, T, k*E]
        return out.hidden if self.feature_layers is None else out.layers

    def _finish(self, drafted: list[int], n: int, nxt: int, g: int, t0: float) -> StepResult:
        step = self.commit(drafted[:n], nxt, drafted=g)
        if not self.stopped_by_eos:
            self.target.truncate(len(self.tokens) - 1)  # keep [.., pending, d_1 .. d_n]
        self.stats.verify_s += device_clock(self.device) - t0
        self.stats.target_forwards += 1
        return step

    def commit(self, accepted: list[int], next_token: int, *, drafted: int) -> StepResult:
        """Append one verified step: the ``accepted`` drafted tokens, then the recovered or
        bonus ``next_token``, cut after the first EOS; count it in the stats. ``drafted``:
        tokens speculated this step (a block's G, a tree's depth). The caller has already
        put the target's cache in shape (truncate or compact)."""
        step = step_tokens(accepted, next_token, drafted, self.eos)
        new = step.emitted
        self.stopped_by_eos = new[-1] in self.eos
        self.tokens.extend(new)
        self.output.extend(new)
        self.stats.record_step(step.drafted, step.accepted, gamma=drafted)
        self.stats.record_emitted(len(new))
        return step
