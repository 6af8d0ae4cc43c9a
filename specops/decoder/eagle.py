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
target's). A greedy request may draft EAGLE-2's dynamic tree instead (`specops.decoder.eagle_tree`). After a verification the target's hidden states at the accepted positions
replace the drafted features: the drafter's cache is cut back to the real entries and
the accepted positions are fed with their real features in one forward.

Cache bookkeeping, for a sequence ``x_0 .. x_{N-1}`` whose last token is pending in the
target: the drafter holds entries ``0 .. N-2`` (all real features), and its output at
entry ``N-2`` predicts ``f_{N-1}`` and so the first drafted token. A drafted chain adds
entries ``N-1 ..`` on predicted features; they are dropped after the verification.

The embedding and LM head are the target's (`EagleDrafter.bind`), never stored with the
drafter. With a *shortlist* (the most frequent tokens of its training data) the drafter
ranks only those rows of the LM head: a drafted token is one of them, outputs stay exact.
Checkpoints (`specops.decoder.eagle_io`) use EAGLE's published tensor names.

An EAGLE-3 drafter (`specops.decoder.eagle3_model.Eagle3Drafter`) runs through the same
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

from specops.decoder.clock import device_clock
from specops.decoder.eagle_model import EagleConfig, EagleDrafter, EagleError
from specops.decoder.errors import InvalidRequestError
from specops.decoder.request import prompt_list
from specops.decoder.runner import ModelRunner, returns_layers
from specops.decoder.sampling import SamplingConfig, probabilities, sample
from specops.decoder.schedule import ConstantSchedule, GammaSchedule
from specops.decoder.speculation import StepResult, TargetVerifier, draft_room
from specops.decoder.stats import DecodeStats
from specops.decoder.step import run_steps

if TYPE_CHECKING:
    from specops.decoder.eagle_tree import EagleTree

__all__ = ["EagleConfig", "EagleDrafter", "EagleError", "EagleProposer", "draft_chain", "generate_eagle"]

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


class EagleProposer:
    """The EAGLE drafter as a `step.Proposer`. It reads the prompt's hidden states after the
    target's prefill (the verifier keeps them: ``keep_features``) and drafts a chain from its
    prediction of the pending token's feature (`draft_chain`). After each verified step it
    drops its drafted entries and keeps the accepted positions' real features; it reads them
    (one drafter forward over every kept position) when it next drafts, so under ``auto`` the
    steps other proposers ran cost it nothing until it drafts again. It falls out of step for
    the rest of the request when a step leaves no features to read (a one-call step that does
    not return them)."""

    method = "eagle"

    def __init__(self, drafter: EagleDrafter, sampling: SamplingConfig, generator: torch.Generator,
                 vocab: int, sample_device: torch.device) -> None:
        self.drafter = drafter
        self.sampling = sampling
        self.generator = generator
        self.vocab = vocab
        self.sample_device = sample_device
        self.device = drafter.fc.weight.device
        self.last: Tensor | None = None  # the drafter's prediction of the pending token's feature [E]
        self.synced = False  # the drafter holds, or has waiting, every real entry
        self.fed = 0  # real entries in the drafter's cache (drafted entries past them are dropped at `sync`)
        self.waiting: list[tuple[list[int], Tensor]] = []  # (tokens, features) of real entries not read yet

    def start(self, v: TargetVerifier) -> None:
        drafter, features, prompt = self.drafter, v.features, v.tokens
        drafter.reset()
        self.last, self.fed, self.waiting = None, 0, []
        if features is not None and draft_room(drafter.max_context, len(prompt)):
            t0 = device_clock(self.device)
            with self.threads():
                self.last = drafter.step(torch.tensor(prompt[1:], device=self.device), features.to(self.device))[-1]
            dt = device_clock(self.device) - t0
            self.fed = len(prompt) - 1
            v.stats.draft_forwards += 1
            v.stats.draft_s += dt
            v.stats.prefill_s += dt
        self.synced = features is not None or len(prompt) == 1

    def room(self, v: TargetVerifier) -> int:
        return draft_room(self.drafter.max_context, len(v.tokens))

    @property
    def ready(self) -> bool:
        """Whether it can draft at the next step (in step, with a prediction made or features waiting)."""
        return self.synced and (self.last is not None or bool(self.waiting))

    def catch_up(self, v: TargetVerifier) -> bool:
        """Read the waiting real entries (one drafter forward); whether the drafter can draft now."""
        if not self.synced:
            return False
        if self.waiting:
            tokens = [t for chunk, _ in self.waiting for t in chunk]
            features = torch.cat([f for _, f in self.waiting]).to(self.device)
            with self.threads():
                self.drafter.truncate(self.fed)
                self.last = self.drafter.step(torch.tensor(tokens, device=self.device), features)[-1]
            self.fed += len(tokens)
            self.waiting = []
            v.stats.draft_forwards += 1
        return self.last is not None

    def propose(self, v: TargetVerifier, gamma: int, limit: int) -> tuple[list[int], Tensor | None]:
        if not self.catch_up(v):
            return [], None
        gamma = min(gamma, limit)
        v.stats.draft_forwards += gamma - 1
        with self.threads():
            self.drafter.truncate(self.fed)
            return draft_chain(self.drafter, self.last, gamma, self.sampling, self.generator, self.vocab,
                               self.sample_device)

    def threads(self):
        """Where the drafter runs on the CPU: its torch ops on the calling thread (`torch_single_thread`)."""
        return torch_single_thread() if self.device.type == "cpu" else contextlib.nullcontext()

    def sync(self, v: TargetVerifier, result: StepResult) -> float:
        """Keep the step's accepted positions (tokens and real features) for the next `catch_up`."""
        if v.done or not self.synced:
            return 0.0
        if v.stats.fallback_reason == "deadline" or len(v.tokens) - 1 > self.drafter.max_context:
            self.synced = False  # no drafting from here on: stop keeping features
            self.waiting = []
            return 0.0
        real = len(v.tokens) - len(result.emitted) - 1  # real entries before this step
        if not v.features_fresh or v.features.shape[0] != len(result.emitted) or self.fed + sum(
                len(chunk) for chunk, _ in self.waiting) != real:
            self.synced = False  # the step left no features of its positions: the drafter cannot follow
            self.waiting = []
            return 0.0
        self.waiting.append((v.tokens[real + 1 :], v.features))  # d_1 .. d_n, next token; their features
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
    chain (`specops.decoder.eagle_tree`; ``schedule`` then unused); sampled requests keep the
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
        from specops.decoder.eagle_tree import EagleTreeProposer

        run_steps(v, EagleTreeProposer(drafter, tree, sampling, generator, target.vocab_size, target.device),
                  ConstantSchedule(tree.depth))
    else:
        run_steps(v, EagleProposer(drafter, sampling, generator, target.vocab_size, target.device),
                  schedule if schedule is not None else ConstantSchedule(4))
    stats.finish(v.stop_reason())
    return v.output, stats
