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
target's). After a verification the target's hidden states at the accepted positions
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
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from specops.decoder.clock import device_clock
from specops.decoder.eagle_model import EagleConfig, EagleDrafter, EagleError
from specops.decoder.errors import InvalidRequestError
from specops.decoder.request import prompt_list
from specops.decoder.runner import ModelRunner, prompt_forward
from specops.decoder.sampling import SamplingConfig, next_token, probabilities, sample
from specops.decoder.schedule import ConstantSchedule, GammaSchedule
from specops.decoder.speculation import DRAFT_CONTEXT, StepResult, TargetVerifier, draft_room
from specops.decoder.stats import DecodeStats
from specops.decoder.verify import accept_greedy, verify_block_sampled

__all__ = ["EagleConfig", "EagleDrafter", "EagleError", "FeatureVerifier", "draft_chain", "generate_eagle"]

log = logging.getLogger(__name__)


class FeatureVerifier(TargetVerifier):
    """`TargetVerifier` that keeps the target's hidden states of the prompt and of every
    accepted position (``features``), which the drafter reads next."""

    features: Tensor | None = None  # [n + 1, E] after `verify`: pending, d_1 .. d_n

    def prefill_features(self) -> Tensor | None:
        """`prefill`, returning the hidden states [P - 1, E] of the prompt's cached tokens (None for a 1-token prompt)."""
        self.target.reset(1)
        if self.prompt_len <= 1:
            return None
        t0 = device_clock(self.device)
        ids = torch.tensor([self.tokens[:-1]], dtype=torch.long, device=self.device)  # [1, P-1]
        hidden = prompt_forward(self.target, ids, logits=False, need_hidden=True).hidden[0]  # [P-1, E]
        dt = device_clock(self.device) - t0
        self.stats.target_forwards += 1
        self.stats.verify_s += dt
        self.stats.prefill_s += dt
        return hidden

    def verify(self, drafted: list[int], draft_probs: Tensor | None = None) -> StepResult:
        """`TargetVerifier.verify`, keeping the accepted positions' hidden states in ``features``."""
        g = len(drafted)
        if g > self.max_draft():
            return super().verify(drafted, draft_probs)  # raises, or runs plainly past the deadline
        t0 = device_clock(self.device)
        if self.block is not None and self.block.applies(g + 1):  # greedy, one C call
            n, nxt = self.block.verify([self.tokens[-1], *drafted])
            self.features = torch.stack([self.block.hidden(g + 1, i) for i in range(n + 1)])
            return self._finish(drafted, n, nxt, g, t0)
        block = torch.tensor([[self.tokens[-1], *drafted]], dtype=torch.long, device=self.device)  # [1, G+1]
        out = self.target.forward(block, need_hidden=True)
        if self.sampling.greedy:
            n, nxt = accept_greedy(drafted, out.choices())
        elif g == 0:
            n, nxt = 0, int(next_token(out.logits[:, 0], self.sampling, self.generator)[0])
        else:
            n, nxt = verify_block_sampled(out.logits[0], drafted, None if draft_probs is None else draft_probs[0],
                                          self.sampling, self.generator)
        self.features = out.hidden[0, : n + 1]
        return self._finish(drafted, n, nxt, g, t0)


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
) -> tuple[list[int], DecodeStats]:
    """Speculative decoding with an EAGLE drafter; γ per step from ``schedule`` (default 4).

    Past ``deadline_s`` the rest is plain decoding; once the sequence outgrows the drafter's
    context (`draft_room`) too (``fallback_reason`` "draft_context")."""
    if not drafter.bound:
        raise InvalidRequestError("the EAGLE drafter is not bound to the target: EagleDrafter.bind(target_model)")
    if drafter.config.vocab_size != target.vocab_size:
        raise InvalidRequestError(f"EAGLE drafter vocabulary ({drafter.config.vocab_size}) differs from the "
                                  f"target's ({target.vocab_size})")
    schedule = schedule if schedule is not None else ConstantSchedule(4)
    prompt = prompt_list(prompt_ids)
    stats = DecodeStats(method="eagle")
    stats.start()
    v = FeatureVerifier(target, prompt, sampling=sampling, generator=generator, max_new_tokens=max_new_tokens,
                        eos_token_id=eos_token_id, stats=stats, deadline_s=deadline_s)
    dev = drafter.fc.weight.device
    features = v.prefill_features()
    drafter.reset()
    last: Tensor | None = None  # the drafter's prediction of the pending token's feature [E]
    if features is not None and draft_room(drafter.max_context, len(prompt)):
        t0 = device_clock(dev)
        last = drafter.step(torch.tensor(prompt[1:], device=dev), features.to(dev))[-1]
        dt = device_clock(dev) - t0
        stats.draft_forwards += 1
        stats.draft_s += dt
        stats.prefill_s += dt
    synced = features is not None or len(prompt) == 1  # the drafter holds every real entry it can
    while not v.done:
        stats.gamma = schedule.next_gamma()
        room = draft_room(drafter.max_context, len(v.tokens))
        if room == 0 and stats.fallback_reason is None:
            stats.fallback_reason = DRAFT_CONTEXT
        gamma = min(stats.gamma, v.max_draft(), room) if synced and last is not None else 0
        real = len(v.tokens) - 1  # the drafter's real entries
        draft_s = 0.0
        if gamma == 0:
            drafted, q = [], None
        else:
            t0 = device_clock(dev)
            drafted, q = draft_chain(drafter, last, gamma, sampling, generator, target.vocab_size, target.device)
            draft_s = device_clock(dev) - t0
            stats.draft_forwards += gamma - 1
            if v.max_draft() < gamma:  # the deadline passed while drafting: this step runs plainly
                drafted, q = [], None
        verify_before = stats.verify_s
        result = v.verify(drafted, q)
        if not v.done and synced:
            if stats.fallback_reason == "deadline" or len(v.tokens) - 1 > drafter.max_context:
                synced = False  # no drafting from here on: stop feeding the drafter
            else:  # drop the drafted entries, feed the accepted positions with their real features
                t0 = device_clock(dev)
                drafter.truncate(real)
                new = torch.tensor(v.tokens[real + 1 :], device=dev)  # d_1 .. d_n, next token
                last = drafter.step(new, v.features.to(dev))[-1]
                dt = device_clock(dev) - t0
                draft_s += dt
                stats.draft_forwards += 1
        stats.draft_s += draft_s
        if gamma:
            schedule.update(gamma, result.raw_accepted, draft_s, stats.verify_s - verify_before)
    stats.finish(v.stop_reason())
    return v.output, stats
