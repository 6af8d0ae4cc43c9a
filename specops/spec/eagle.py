"""EAGLE feature drafting (Li et al. 2024, arXiv 2401.15077): a one-layer drafter that
extrapolates the target's own last hidden states.

The drafter is one decoder layer (RoPE attention with its own KV cache, SwiGLU MLP,
RMSNorms) sized from the target's config. Its entry ``i`` reads

    fc([e(x_{i+1}); f_i])            (2E -> E)

where ``f_i`` is the target's last hidden state (after the final norm) at position ``i``
and ``e`` the target's frozen input embedding, and outputs a prediction of ``f_{i+1}``;
the target's frozen LM head turns that into the token ``x_{i+2}``. Drafting a chain of γ
tokens runs the layer on its own predicted features (argmax at temperature 0; at
temperature > 0 a sample from the drafter's filtered distribution q, which the sampling
verification of `speculation.TargetVerifier` receives, so the output is distributed as the
target's). A greedy request may draft EAGLE-2's dynamic tree instead
(`specops.spec.eagle_tree`). After a verification the target's hidden states at the
accepted positions replace the drafted features: the drafter's cache is cut back to the real
entries and the accepted positions are fed with their real features in one forward.

Cache bookkeeping, for a sequence ``x_0 .. x_{N-1}`` whose last token is pending in the
target: the drafter holds entries ``0 .. N-2`` (all real features), and its output at
entry ``N-2`` predicts ``f_{N-1}`` and so the first drafted token. A drafted chain adds
entries ``N-1 ..`` on predicted features; they are dropped right after drafting. One
sequence's side of this is an `EagleCursor`: its own drafter cache (`EagleDrafter.new_cache`,
sized for the request), the real entries fed and those waiting to be fed, and the last
prediction. `EagleProposer` here keeps one per request and the serving engine one per
sequence (`specops.engine.eagle_proposer`); they differ only in where the real features come
from (the verifier's ``features`` here, the engine's batched hidden rows there).

The embedding and LM head are the target's (`EagleDrafter.bind`), never stored with the
drafter. With a *shortlist* (the most frequent tokens of its training data) the drafter
ranks only those rows of the LM head: a drafted token is one of them, outputs stay exact.
Checkpoints (`specops.models.eagle_io`) use EAGLE's published tensor names.

An EAGLE-3 drafter (`specops.models.eagle3_model.Eagle3Drafter`) runs through the same
code: its ``f_i`` are three intermediate target hidden states side by side (its
`feature_layers`, which the verifier keeps: ``keep_features``), it has its own LM head over a
reduced vocabulary, and its ``shortlist`` holds the target ids of those tokens (``d2t``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specops.spec.clock import device_clock
from specops.models.eagle_model import EagleConfig, EagleDrafter, EagleError
from specops.spec.errors import InvalidRequestError
from specops.spec.request import prompt_list
from specops.models.runner import ModelRunner, returns_layers
from specops.spec.sampling import SamplingConfig, probabilities, sample
from specops.spec.schedule import ConstantSchedule, GammaSchedule
from specops.spec.speculation import StepResult, TargetVerifier, draft_room
from specops.spec.stats import DecodeStats
from specops.spec.step import run_steps

if TYPE_CHECKING:
    from specops.spec.eagle_tree import EagleTree
    from specops.spec.step import DraftTree

__all__ = ["EagleConfig", "EagleCursor", "EagleDrafter", "EagleError", "EagleProposer", "draft_chain",
           "generate_eagle"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def torch_single_thread():
    """Run the drafter's small torch ops on the calling thread alone. Its products run on the C
    kernels' own pool; a torch op that forked torch's OpenMP team left those threads spinning
    for a while after it, on the cores the next target forward's pool needs (on 2 cores the
    real model's 5-position verifications took ~1.8x a 1-position forward, not ~1.2x). Restored
    on exit."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def draft_chain(drafter: EagleDrafter, last: Tensor, gamma: int, sampling: SamplingConfig,
                 generator: torch.Generator, vocab: int, device: torch.device,
                 cache=None) -> tuple[list[int], Tensor | None]:
    """γ tokens from the predicted feature ``last`` [E]: each token from the LM head at the current
    feature, the next feature from one drafter step on (token, feature). q: [1, G, V] when sampling.
    ``cache``: the sequence's drafter cache (`EagleDrafter.new_cache`; None: the drafter's own),
    which gains γ - 1 entries on predicted features."""
    shortlist = drafter.shortlist
    drafted: list[int] = []
    q_rows: list[Tensor] = []
    feature = last
    for k in range(gamma):
        logits = drafter.logits(feature)  # [F] or [V]
        if sampling.greedy:
            index = int(torch.argmax(logits))
        else:
            q = probabilities(logits.to(device), sampling)  # [F]
            index = int(sample(q, generator))
            if shortlist is not None:
                q = torch.zeros(vocab, dtype=q.dtype, device=device).index_copy_(0, shortlist.to(device), q)
            q_rows.append(q)
        tok = index if shortlist is None else int(shortlist[index])
        drafted.append(tok)
        if k + 1 < gamma:
            feature = drafter.step(torch.tensor([tok], device=feature.device), feature[None], cache)[0]
    return drafted, (torch.stack(q_rows)[None] if q_rows else None)


class EagleCursor:
    """One sequence's state in an EAGLE drafter (see the module docstring's cache bookkeeping).

    It owns the sequence's drafter KV cache (`EagleDrafter.new_cache` of ``max_len`` entries,
    allocated at the first `catch_up`), the count of real entries the cache holds (``fed``), the
    drafter's prediction of the pending token's feature (``last``), the real entries kept but not
    fed yet (``waiting``: (tokens, features) chunks in order) and whether it is still in step with
    the sequence (``in_step``). Outside `chain` and `tree` the cache holds exactly the ``fed`` real
    entries: drafted entries rest on predicted features and are cut off before those return.
    The caller runs it under the drafter's thread setting (`torch_single_thread`) and grad mode."""

    def __init__(self, drafter, max_len: int) -> None:
        self.drafter = drafter
        self.max_len = max_len  # entries the cache is allocated for (`new_cache` caps it at the drafter's context)
        self.cache = None
        self.fed = 0
        self.last: Tensor | None = None
        self.waiting: list[tuple[list[int], Tensor]] = []
        self.unfed = 0
        """Real entries kept and not fed yet (the tokens of ``waiting``; counted as they come: a
        sequence the planner keeps from drafting adds a chunk every step, and the engine reads
        this count every step)."""
        self.in_step = True

    @property
    def known(self) -> int:
        """Real entries fed or waiting."""
        return self.fed + self.unfed

    @property
    def ready(self) -> bool:
        """Whether it can draft once it has caught up (in step, with a prediction made or entries waiting)."""
        return self.in_step and (self.last is not None or bool(self.waiting))

    def keep(self, tokens: list[int], features: Tensor) -> None:
        """Append real entries: entry ``i`` reads ``tokens[i]`` (the token after the position whose
        target hidden state is ``features[i]``); features [len(tokens), E] (or [., k*E], EAGLE-3)."""
        self.waiting.append((tokens, features))
        self.unfed += len(tokens)

    def catch_up(self) -> bool:
        """Feed every waiting entry in one drafter step (its last output is the new ``last``);
        whether it can draft now (in step, with a prediction)."""
        if not self.in_step:
            return False
        if self.waiting:
            drafter = self.drafter
            device = drafter.fc.weight.device
            if self.cache is None:
                self.cache = drafter.new_cache(self.max_len)
            tokens = [t for chunk, _ in self.waiting for t in chunk]
            chunks = [f for _, f in self.waiting]
            features = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            self.last = drafter.step(torch.tensor(tokens, dtype=torch.long, device=device), features.to(device),
                                     self.cache)[-1]
            self.fed += len(tokens)
            self.waiting, self.unfed = [], 0
        return self.last is not None

    def chain(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator, vocab: int,
              device: torch.device) -> tuple[list[int], Tensor | None]:
        """`draft_chain` of γ tokens from ``last`` on the cache (after a `catch_up` that returned
        True); the cache is cut back to the real entries after."""
        try:
            return draft_chain(self.drafter, self.last, gamma, sampling, generator, vocab, device, self.cache)
        finally:
            self.cache.truncate(self.fed)

    def depth_room(self, depth: int, topk: int) -> int:
        """``depth`` cut to the tree levels the cache holds past the real entries: ``topk`` entries
        per level but the last (after a `catch_up`)."""
        return min(depth, 1 + (self.cache.max_len - self.fed) // topk)

    def tree(self, shape: EagleTree, depth: int, size: int, root: int, device: torch.device,
             estimates: list[float] | None = None) -> tuple[DraftTree, int]:
        """`eagle_tree.draft_tree` after the pending token ``root`` from ``last`` on the cache (after a
        `catch_up` that returned True; ``depth`` within `depth_room`): the tree and the drafter
        forwards it ran. The cache is cut back to the real entries after."""
        from specops.spec import eagle_tree

        try:
            return eagle_tree.draft_tree(self.drafter, self.last, root, shape, depth, size, device, self.cache,
                                         estimates)
        finally:
            self.cache.truncate(self.fed)

    def clear(self) -> None:
        """Drop the cache, the prediction and every real entry (the sequence is fed again from its start)."""
        self.cache, self.fed, self.last, self.waiting, self.unfed = None, 0, None, [], 0

    def stop(self) -> None:
        """Out of step for good: `clear`, and `catch_up` never drafts again."""
        self.clear()
        self.in_step = False


class EagleProposer:
    """The EAGLE drafter as a `step.Proposer`. It reads the prompt's hidden states after the
    target's prefill (the verifier keeps them: ``keep_features``) and drafts a chain from its
    prediction of the pending token's feature (`draft_chain`), on the request's `EagleCursor`.
    After each verified step its cursor keeps the accepted positions' real features; it reads
    them (one drafter forward over every kept position) when it next drafts, so under ``auto``
    the steps other proposers ran cost it nothing until it drafts again. It falls out of step for
    the rest of the request when a step leaves no features to read (a one-call step that does
    not return them)."""

    method = "eagle"
    extra_entries = 0
    """Drafter cache entries a drafting needs past the sequence's own (a tree's expanded levels)."""

    def __init__(self, drafter: EagleDrafter, sampling: SamplingConfig, generator: torch.Generator,
                 vocab: int, sample_device: torch.device) -> None:
        self.drafter = drafter
        self.sampling = sampling
        self.generator = generator
        self.vocab = vocab
        self.sample_device = sample_device
        self.device = drafter.fc.weight.device
        self.cursor: EagleCursor | None = None  # the request's drafter state (`start`)

    def start(self, v: TargetVerifier) -> None:
        """A cursor sized for the request (prompt, budget and a tree's levels) that reads the prompt's
        features when the drafter has room for it; out of step when the prefill kept none."""
        features, prompt = v.features, v.tokens
        self.cursor = cursor = EagleCursor(self.drafter, v.prompt_len + v.budget + self.extra_entries)
        if features is not None and draft_room(self.drafter.max_context, len(prompt)):
            t0 = device_clock(self.device)
            cursor.keep(prompt[1:], features)
            with self.threads():
                cursor.catch_up()
            dt = device_clock(self.device) - t0
            v.stats.draft_forwards += 1
            v.stats.draft_s += dt
            v.stats.prefill_s += dt
        if features is None and len(prompt) > 1:
            cursor.stop()

    def room(self, v: TargetVerifier) -> int:
        return draft_room(self.drafter.max_context, len(v.tokens))

    @property
    def ready(self) -> bool:
        """Whether it can draft at the next step (in step, with a prediction made or features waiting)."""
        return self.cursor is not None and self.cursor.ready

    def catch_up(self, v: TargetVerifier) -> bool:
        """Read the waiting real entries (one drafter forward); whether the drafter can draft now."""
        cursor = self.cursor
        if cursor.in_step and cursor.waiting:
            v.stats.draft_forwards += 1
        with self.threads():
            return cursor.catch_up()

    def propose(self, v: TargetVerifier, gamma: int, limit: int) -> tuple[list[int], Tensor | None]:
        if not self.catch_up(v):
            return [], None
        gamma = min(gamma, limit)
        v.stats.draft_forwards += gamma - 1
        with self.threads():
            return self.cursor.chain(gamma, self.sampling, self.generator, self.vocab, self.sample_device)

    def threads(self):
        """Where the drafter runs on the CPU: its torch ops on the calling thread (`torch_single_thread`)."""
        return torch_single_thread() if self.device.type == "cpu" else contextlib.nullcontext()

    def sync(self, v: TargetVerifier, result: StepResult) -> float:
        """Keep the step's accepted positions (tokens and real features) for the next `catch_up`."""
        cursor = self.cursor
        if v.done or not cursor.in_step:
            return 0.0
        if v.stats.fallback_reason == "deadline" or len(v.tokens) - 1 > self.drafter.max_context:
            cursor.stop()  # no drafting from here on: stop keeping features
            return 0.0
        real = len(v.tokens) - len(result.emitted) - 1  # real entries before this step
        if not v.features_fresh or v.features.shape[0] != len(result.emitted) or cursor.known != real:
            cursor.stop()  # the step left no features of its positions: the drafter cannot follow
            return 0.0
        cursor.keep(v.tokens[real + 1 :], v.features)  # d_1 .. d_n, next token; their features
        return 0.0


def generate_eagle(
    target: ModelRunner,
    drafter: EagleDrafter,
    prompt_ids: Tensor,  # [1, T] long
    *,
    sampling: SamplingConfig,
    generator: torch.Generator,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    schedule: GammaSchedule | None = None,
    deadline_s: float | None = None,
    tree: EagleTree | None = None,
) -> tuple[list[int], DecodeStats]:
    """Speculative decoding with an EAGLE drafter; γ per step from ``schedule`` (default 4).

    ``tree``: greedy requests draft EAGLE-2's dynamic tree of that shape each step instead of a
    chain (`specops.spec.eagle_tree`; ``schedule`` then unused); sampled requests keep the
    chain, whose rejection sampling against the drafter's q is lossless. Past ``deadline_s``
    the rest is plain decoding; once the sequence outgrows the drafter's context (`draft_room`)
    too (``fallback_reason`` "draft_context")."""
    if not drafter.bound:
        raise InvalidRequestError("the EAGLE drafter is not bound to the target: EagleDrafter.bind(target_model)")
    if drafter.config.vocab_size != target.vocab_size:
        raise InvalidRequestError(f"EAGLE drafter vocabulary ({drafter.config.vocab_size}) differs from the "
                                  f"target's ({target.vocab_size})")
    layers = drafter.feature_layers
    if layers is not None and not returns_layers(target):
        raise InvalidRequestError(f"the EAGLE-3 drafter reads the target's hidden_states {list(layers)}, which "
                                  f"{type(target).__name__} does not return: run the target with impl='hf'")
    stats = DecodeStats(method="eagle")
    stats.start()
    v = TargetVerifier(target, prompt_list(prompt_ids), sampling=sampling, generator=generator,
                       max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, stats=stats, deadline_s=deadline_s,
                       keep_features=True if layers is None else layers)
    if tree is not None and sampling.greedy:
        from specops.spec.eagle_tree import EagleTreeProposer

        run_steps(v, EagleTreeProposer(drafter, tree, sampling, generator, target.vocab_size, target.device),
                  ConstantSchedule(tree.depth))
    else:
        run_steps(v, EagleProposer(drafter, sampling, generator, target.vocab_size, target.device),
                  schedule if schedule is not None else ConstantSchedule(4))
    stats.finish(v.stop_reason())
    return v.output, stats
