"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Each step: the draft model proposes γ tokens autoregressively, the target verifies all
of them in one forward pass over only the new positions (`speculation.TargetVerifier`),
and both KV caches are cut back to the accepted prefix. Nothing of the prefix is ever
recomputed:

* the target cache always holds the sequence minus its last (pending) token;
* the draft cache holds a prefix of the sequence; before drafting, the draft runs
  every token it has not seen yet. That is the pending token alone, or, after a
  fully accepted block, ``[d_G, bonus]`` (``d_G`` was sampled but never fed back).

The draft's distributions ``q`` are filtered exactly like the target's ``p``
(`specops.spec.sampling`), which makes the output distribution the filtered
target distribution.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from specops.spec.clock import device_clock
from specops.spec.errors import InvalidRequestError, VocabMismatchError
from specops.spec.request import prompt_list
from specops.models.runner import ModelRunner, prompt_forward
from specops.spec.sampling import SamplingConfig, probabilities, sample
from specops.spec.schedule import ConstantSchedule, GammaSchedule
from specops.spec.speculation import StepResult, TargetVerifier, draft_room
from specops.spec.stats import DecodeStats
from specops.spec.step import run_steps


def check_vocab(target: ModelRunner, draft: ModelRunner) -> None:
    """Raise `VocabMismatchError` unless draft and target share the vocabulary size."""
    if target.vocab_size != draft.vocab_size:
        raise VocabMismatchError(
            f"draft vocabulary ({draft.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size} tokens); the draft must use the target's tokenizer"
        )


def chain_draws(sampling: SamplingConfig, generator: torch.Generator) -> bool:
    """Whether a C drafting chain draws a request's tokens as `draft_rounds` would: greedy, or
    softmax(logits / T) alone (no top-k / top-p filter) with 1 / T a finite float32 and the
    generator on the CPU (the chain takes one of its uniforms per token, `chain_uniforms`)."""
    if sampling.greedy:
        return True
    return (sampling.unfiltered and generator.device.type == "cpu"
            and math.isfinite(float(np.float32(1.0 / sampling.temperature))))


def chain_uniforms(count: int, generator: torch.Generator) -> torch.Tensor:
    """[count] float64 on the CPU: the uniforms a C drafting chain draws ``count`` sampled tokens
    with, one per token from the request's own generator, as `sampling.draw` takes them."""
    return torch.rand(count, generator=generator, dtype=torch.float64, device=generator.device).cpu()


def draft_rounds(forward: Callable[[list[int], list[int] | None], list[torch.Tensor]], gammas: list[int],
                 samplings: list[SamplingConfig], generators: list[torch.Generator],
                 after_round: Callable[[], None] | None = None,
                 ) -> list[tuple[list[int], torch.Tensor | None]]:
    """Draft ``gammas[i]`` tokens for every request i, autoregressively, in max(γ_i) rounds: the
    drafting rule of `DraftModelProposer` (a batch of one) and of the engine's batched draft model
    (`specops.engine.proposers.draft_blocks`). Per request: its tokens and their q rows [γ_i, V]
    (None when greedy).

    ``forward(active, fed)`` runs the draft model for the requests ``active`` (indices, in order)
    and returns each one's next-token logits row [1, V]; ``fed`` is None in the first round (each
    request feeds what its draft cache lacks) and then each active request's last drafted token.
    A request leaves the batch once it has its γ_i tokens (ragged speculation). Greedy requests
    take the argmax (one call over the round's rows); sampled ones draw from q, filtered exactly
    like the target's distribution (`specops.spec.sampling`), with their own generator.
    ``after_round()``: called at the end of every round (the engine times a round's forward and
    host work together)."""
    drafted: list[list[int]] = [[] for _ in gammas]
    qs: list[list[torch.Tensor]] = [[] for _ in gammas]
    active = [i for i, g in enumerate(gammas) if g > 0]
    fed: list[int] | None = None
    while active:
        rows = forward(active, fed)
        argmax = None
        if any(samplings[i].greedy for i in active):
            argmax = (rows[0] if len(rows) == 1 else torch.cat(rows)).argmax(-1).tolist()  # one call for the round
        for j, (i, logits) in enumerate(zip(active, rows)):
            if samplings[i].greedy:
                tok = argmax[j]
            else:
                q = probabilities(logits.to(generators[i].device), samplings[i])  # [1, V]
                tok = int(sample(q, generators[i])[0])
                qs[i].append(q[0])
            drafted[i].append(tok)
        active = [i for i in active if len(drafted[i]) < gammas[i]]
        fed = [drafted[i][-1] for i in active]
        if after_round is not None:
            after_round()
    return [(d, torch.stack(q) if q else None) for d, q in zip(drafted, qs)]


def _draft_block(
    draft: ModelRunner,
    tokens: list[int],
    gamma: int,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> tuple[list[int], torch.Tensor | None]:  # drafted tokens, q: [1, G, V] (sampling only)
    """Propose ``gamma`` tokens after ``tokens``, feeding the draft only what its cache lacks."""
    unseen = tokens[draft.cache_len :]  # 1 or 2 tokens (the whole prompt at `auto`'s first draft step)
    chain = getattr(draft, "draft_chain", None)  # the whole block in one C call (fast runner, fp32 CPU)
    if chain is not None and chain_draws(sampling, generator):
        if sampling.greedy:
            done = chain(unseen, gamma)
            if done is not None:
                return done[0], None
        else:
            done = chain(unseen, gamma, uniforms=chain_uniforms(gamma, generator), temperature=sampling.temperature)
            if done is not None:
                return done[0], done[1][None]  # q: [1, G, V]

    def forward(active: list[int], fed: list[int] | None) -> list[torch.Tensor]:
        ids = unseen if fed is None else fed
        return [draft.forward(torch.tensor([ids], dtype=torch.long, device=draft.device)).logits[:, -1]]  # [1, V]

    (drafted, q), = draft_rounds(forward, [gamma], [sampling], [generator])
    return drafted, None if q is None else q[None]  # q: [1, G, V]


CATCHUP_FREE = 2
"""Unseen tokens a draft step feeds anyway: the pending one, and the bonus after a full block.
More than that (the prompt, when the draft did not read it at the start; the tokens of other
drafters' steps in `auto`) are read first in one forward without logits (`DraftModelProposer`)."""


class DraftModelProposer:
    """A draft model as a `step.Proposer`: it drafts γ tokens autoregressively (`_draft_block`),
    and after verification its cache is cut back to the accepted prefix."""

    method = "draft"

    def __init__(self, draft: ModelRunner, sampling: SamplingConfig, generator: torch.Generator, *,
                 prefill: bool = True,
                 on_catch_up: Callable[[int, float], None] | None = None) -> None:
        """``prefill``: read the prompt at `start` (False: at the first step, so a request that never
        drafts never pays for it, as `auto`'s requests). ``on_catch_up(tokens, seconds)``: called
        after the draft read more than CATCHUP_FREE unseen tokens before a step (``caught_up``
        holds that step's seconds, 0 when none)."""
        self.draft = draft
        self.sampling = sampling
        self.generator = generator
        self.device = draft.device
        self.prefill = prefill
        self.on_catch_up = on_catch_up
        self.caught_up = 0.0

    def start(self, v: TargetVerifier) -> None:
        draft = self.draft
        draft.reset(1)
        prompt = v.tokens
        if self.prefill and len(prompt) > 1 and draft_room(draft.max_context, len(prompt)):  # else it never drafts
            t0 = device_clock(draft.device)
            prompt_forward(draft, torch.tensor([prompt[:-1]], dtype=torch.long, device=draft.device), logits=False)
            dt = device_clock(draft.device) - t0
            v.stats.draft_forwards += 1
            v.stats.draft_s += dt
            v.stats.prefill_s += dt

    def room(self, v: TargetVerifier) -> int:
        return draft_room(self.draft.max_context, len(v.tokens))

    def propose(self, v: TargetVerifier, gamma: int, limit: int) -> tuple[list[int], torch.Tensor | None]:
        draft = self.draft
        self.caught_up = 0.0
        unseen = len(v.tokens) - draft.cache_len
        if unseen > CATCHUP_FREE:  # read all but the pending token in one forward
            t0 = device_clock(draft.device)
            prompt_forward(draft, torch.tensor([v.tokens[draft.cache_len : -1]], dtype=torch.long,
                                               device=draft.device), logits=False)
            self.caught_up = device_clock(draft.device) - t0
            v.stats.draft_forwards += 1
            if self.on_catch_up is not None:
                self.on_catch_up(unseen - 1, self.caught_up)
        gamma = min(gamma, limit)
        v.stats.draft_forwards += gamma
        return _draft_block(draft, v.tokens, gamma, self.sampling, self.generator)

    def sync(self, v: TargetVerifier, result: StepResult) -> float:
        if not v.done:
            # keep the draft's entries for [.., pending, d_1 .. d_n]; d_G (never fed) is
            # re-fed with the bonus token next step when everything was accepted
            self.draft.truncate(min(self.draft.cache_len, len(v.tokens) - 1))
        return 0.0


def generate_draft(
    target: ModelRunner,
    draft: ModelRunner,
    prompt_ids: torch.Tensor,  # [B, T] long, B == 1
    *,
    sampling: SamplingConfig,
    generator: torch.Generator,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    schedule: GammaSchedule | None = None,
    deadline_s: float | None = None,
) -> tuple[list[int], DecodeStats]:
    """Speculative decoding with a draft model; γ per step comes from ``schedule`` (default 4).

    Past ``deadline_s`` seconds the rest is plain decoding (see `speculation`), and so is the
    rest once the sequence outgrows the draft's context (`draft_room`; the target's context
    bounds the request).
    """
    check_vocab(target, draft)
    if max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stats = DecodeStats(method="draft")
    stats.start()
    v = TargetVerifier(target, prompt_list(prompt_ids), sampling=sampling, generator=generator,
                       max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, stats=stats, deadline_s=deadline_s)
    run_steps(v, DraftModelProposer(draft, sampling, generator),
              schedule if schedule is not None else ConstantSchedule(4))
    stats.finish(v.stop_reason())
    return v.output, stats
