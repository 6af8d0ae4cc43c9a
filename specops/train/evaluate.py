"""Measure a target/draft pair: the draft's greedy acceptance against the target.

In greedy speculative decoding the draft always continues the accepted prefix, which
is the target's own greedy output. So one teacher-forced pass of the draft over
(prompt + target greedy continuation) gives, at every position, whether the draft's
argmax equals the target's: ``agree[i]``. Replaying γ-sized blocks over that vector
reproduces exactly what a speculative decoder would accept: a block starting at
position s accepts the leading run of agreements (at most γ), then the target adds
one token (the correction, or the bonus token after a fully accepted block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class AcceptanceReport:
    """Greedy acceptance of a draft against a target over some prompts."""

    gamma: int
    prompts: int
    new_tokens: int
    top1_agreement: float        # P(draft argmax == target argmax) on the target's path
    drafted: int
    accepted: int
    target_forwards: int
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per target forward (accepted + the target's own token)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def as_dict(self) -> dict:
        return {
            "gamma": self.gamma, "prompts": self.prompts, "new_tokens": self.new_tokens,
            "top1_agreement": round(self.top1_agreement, 4), "drafted": self.drafted,
            "accepted": self.accepted, "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_len": round(self.mean_accepted_len, 4), "target_forwards": self.target_forwards,
            "accepted_per_pos": self.accepted_per_pos,
        }


def replay_blocks(agree: Sequence[bool], gamma: int) -> tuple[int, int, int, list[int]]:
    """Replay greedy speculation over an agreement vector of length n (the new tokens).

    Returns (drafted, accepted, target_forwards, accepted_per_pos[gamma]); drafting
    never runs past the end (the last block drafts only the tokens still needed - 1).
    """
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    n = len(agree)
    drafted = accepted = forwards = 0
    per_pos = [0] * gamma
    s = 0
    while s < n:
        g = min(gamma, n - s - 1)  # the target always contributes one token per forward
        run = 0
        while run < g and agree[s + run]:
            per_pos[run] += 1
            run += 1
        drafted += g
        accepted += run
        forwards += 1
        s += run + 1
    return drafted, accepted, forwards, per_pos


@torch.no_grad()
def greedy_acceptance(target, draft, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
                      gamma: int = 4, eos_token_id: int | None = None) -> AcceptanceReport:
    """Greedy acceptance of ``draft`` vs ``target`` on token-id ``prompts``."""
    if not prompts:
        raise ValueError("no prompts")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"vocabularies differ: target {target.config.vocab_size}, draft {draft.config.vocab_size}")
    target.eval()
    draft.eval()
    drafted = accepted = forwards = total_new = agree_total = 0
    per_pos = [0] * gamma
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long)            # [1, P]
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                              pad_token_id=eos_token_id if eos_token_id is not None else 0)  # [1, P+N]
        n = out.shape[1] - ids.shape[1]
        if n == 0:
            continue
        seq = out[:, :-1]                                                # [1, P+N-1]
        p_idx = torch.arange(ids.shape[1] - 1, out.shape[1] - 1)         # [N] positions predicting new tokens
        t_arg = out[0, ids.shape[1]:]                                    # [N] the target's greedy tokens
        d_arg = draft(input_ids=seq, use_cache=False).logits[0, p_idx].argmax(-1)   # [N]
        agree = (t_arg == d_arg).tolist()
        d, a, f, pp = replay_blocks(agree, gamma)
        drafted, accepted, forwards = drafted + d, accepted + a, forwards + f
        per_pos = [x + y for x, y in zip(per_pos, pp)]
        total_new += n
        agree_total += sum(agree)
    return AcceptanceReport(gamma=gamma, prompts=len(prompts), new_tokens=total_new,
                            top1_agreement=agree_total / max(1, total_new), drafted=drafted,
                            accepted=accepted, target_forwards=forwards, accepted_per_pos=per_pos)
