"""Verification of drafted tokens against the target model: greedy and lossless sampling.

Terms (used the same way across specops, its stats and its metrics)
-------------------------------------------------------------------
drafted token
    a token proposed by a drafter (draft model, n-gram lookup, Medusa head) for the
    position after the current prefix; a *block* of G drafted tokens is verified in
    one target forward pass over the G + 1 positions ``[pending, d_1 .. d_G]``.
accepted token
    a drafted token the target agrees with. Greedy: ``d_i`` equals the target's argmax
    at its position. Sampling: ``d_i`` survives the test ``u < p(d_i) / q(d_i)`` with
    ``u ~ U[0, 1)``, i.e. it is kept with probability ``min(1, p(d_i) / q(d_i))``.
    Only a prefix of the block can be accepted: verification stops at the first
    rejection.
rejected token
    the first drafted token that fails the test; it and everything after it in the
    block are discarded (and the KV cache entries they created are rolled back).
recovered token
    the token emitted in place of a rejected one. Greedy: the target's argmax there.
    Sampling: a sample from the residual distribution ``norm(max(0, p - q))``, which
    corrects the bias of the accept test so the emitted token is distributed exactly
    as ``p``.
bonus token
    when all G drafted tokens are accepted, the target's distribution at the position
    after the last one is already computed, so one more token is drawn from it (argmax
    when greedy) for free.

Every verification step therefore emits ``accepted + 1`` tokens. With the same
sampling filters applied to ``p`` and ``q`` (`specops.spec.sampling`) the output is
distributed exactly as sampling the filtered target alone, which is the theorem of

* Y. Leviathan, M. Kalman, Y. Matias. *Fast Inference from Transformers via
  Speculative Decoding*. ICML 2023, arXiv:2211.17192 (Algorithm 1, Theorem 1).
* C. Chen, S. Borgeaud, G. Irving, J.-B. Lespiau, L. Sifre, J. Jumper. *Accelerating
  Large Language Model Decoding with Speculative Sampling*. 2023, arXiv:2302.01318.

A deterministic drafter (n-gram lookup, greedy Medusa candidates) is the special case
``q = one_hot(d)``: the token is accepted with probability ``p(d)`` and the residual is
``p`` with ``d`` removed, renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specops.spec.sampling import SamplingConfig, draw, probabilities
from specops.kernels import cpu_linear


@dataclass
class Verification:
    """Outcome of verifying one block of drafted tokens per sequence."""

    accepted: torch.Tensor  # [B] long: accepted draft tokens, 0..G
    next_tokens: torch.Tensor  # [B] long: recovered token (accepted < G) or bonus token (accepted == G)


def _check_block(draft_tokens: torch.Tensor, target: torch.Tensor, name: str) -> tuple[int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, G], got shape {tuple(draft_tokens.shape)}")
    b, g = draft_tokens.shape
    if target.dim() != 3 or target.shape[0] != b or target.shape[1] != g + 1:
        raise ValueError(f"{name} must be [B, G+1, V] = [{b}, {g + 1}, V], got shape {tuple(target.shape)}")
    return b, g


def _accepted_prefix(ok: torch.Tensor) -> torch.Tensor:  # ok: [B, G] bool -> [B] long
    """Length of the leading run of True in each row."""
    if ok.shape[1] == 0:
        return torch.zeros(ok.shape[0], dtype=torch.long, device=ok.device)
    return torch.cumprod(ok.long(), dim=1).sum(dim=1)


def accept_greedy(drafted: list[int], choice: list[int], offset: int = 0) -> tuple[int, int]:
    """`verify_greedy`'s rule on plain ints for one sequence: (accepted, next token) for the
    ``drafted`` tokens given the target's argmax ``choice[offset + i]`` at each of their G + 1
    positions. A decoding loop of one sequence (and the engine, per sequence of its batch)
    compares the few ints in Python: the tensor form is ~6 tensor ops per step, each run
    cache-cold after the forward that evicted the interpreter's working set (0.2 ms per step
    of the draft method, measured in its loop, against a few microseconds for the ints)."""
    n = 0
    while n < len(drafted) and drafted[n] == choice[offset + n]:
        n += 1
    return n, choice[offset + n]


def verify_greedy(
    draft_tokens: torch.Tensor,  # [B, G] long
    target_logits: torch.Tensor,  # [B, G+1, V]: target logits at [pending, d_1 .. d_G]
) -> Verification:
    """Accept drafted tokens while they equal the target's argmax; then its argmax follows."""
    _check_block(draft_tokens, target_logits, "target_logits")
    choice = cpu_linear.argmax(target_logits)  # [B, G+1]
    accepted = _accepted_prefix(draft_tokens == choice[:, :-1])  # [B]
    next_tokens = choice.gather(1, accepted[:, None])[:, 0]  # [B]
    return Verification(accepted=accepted, next_tokens=next_tokens)


def verify_sampling(
    draft_tokens: torch.Tensor,  # [B, G] long, drawn from draft_probs (or chosen deterministically)
    target_probs: torch.Tensor,  # [B, G+1, V] filtered target distributions p
    draft_probs: torch.Tensor | None,  # [B, G, V] filtered draft distributions q; None = point mass on the draft
    generator: torch.Generator,
) -> Verification:
    """Lossless rejection sampling (Leviathan et al. 2023, Algorithm 1).

    Random numbers are drawn in a fixed order from ``generator`` (``B*G`` uniforms,
    then one categorical draw per row) so a seeded request is reproducible.
    """
    b, g = _check_block(draft_tokens, target_probs, "target_probs")
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, vocab).to(target_probs.dtype)  # [B, G, V]
    elif tuple(draft_probs.shape) != (b, g, vocab):
        raise ValueError(f"draft_probs must be [B, G, V] = [{b}, {g}, {vocab}], got shape {tuple(draft_probs.shape)}")
    draft_probs = draft_probs.to(device=target_probs.device, dtype=target_probs.dtype)
    idx = draft_tokens[:, :, None]  # [B, G, 1]
    p_x = target_probs[:, :g].gather(2, idx)[:, :, 0]  # [B, G]
    q_x = draft_probs.gather(2, idx)[:, :, 0]  # [B, G]
    u = torch.rand((b, g), generator=generator, device=target_probs.device, dtype=target_probs.dtype)  # [B, G]
    accepted = _accepted_prefix(u * q_x < p_x)  # [B]; u < p/q without dividing by q

    # Row `accepted` of p, minus row `accepted` of q padded with a zero row, so that a
    # fully accepted block (accepted == G) yields the bonus distribution p[G] itself.
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(b, 1, vocab)], dim=1)  # [B, G+1, V]
    gather_idx = accepted[:, None, None].expand(b, 1, vocab)  # [B, 1, V]
    p_n = target_probs.gather(1, gather_idx)[:, 0]  # [B, V]
    q_n = q_padded.gather(1, gather_idx)[:, 0]  # [B, V]
    residual = torch.clamp(p_n - q_n, min=0.0)  # [B, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
    # mass == 0 only when p == q up to rounding, where rejection has probability ~0;
    # sampling p itself is then the exact limit.
    dist = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), p_n)  # [B, V]
    next_tokens = draw(dist, generator)  # [B]
    return Verification(accepted=accepted, next_tokens=next_tokens)


def verify_block_sampled(
    logits: torch.Tensor,  # [G+1, V]: target logits at [pending, d_1 .. d_G]
    drafted: list[int],
    draft_probs: torch.Tensor | None,  # [G, V] the drafter's filtered distributions; None = deterministic
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> tuple[int, int]:
    """One sequence's sampled block: (accepted drafted tokens, the next token). With
    temperature only (no top-k / top-p), fp32 logits and a generator on the CPU, softmax and
    rejection run in one C call (`cpu_linear.verify_sampled`: the same uniforms in the same
    roles; a 5-token block's torch ops took ~0.5 ms between two forwards); else
    `verify_sampling` over `sampling.probabilities`. Shared by `TargetVerifier` and the
    serving engine."""
    if (sampling.unfiltered and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and generator.device.type == "cpu" and cpu_linear.available()):
        q = None if draft_probs is None else draft_probs.float().contiguous()
        return cpu_linear.verify_sampled(logits.contiguous(), drafted, q, sampling.temperature, generator)
    d = torch.tensor([drafted], dtype=torch.long, device=logits.device)  # [1, G]
    p = probabilities(logits[None], sampling)  # [1, G+1, V]
    q = None if draft_probs is None else draft_probs[None].to(p.device)  # [1, G, V]
    v = verify_sampling(d, p, q, generator)
    return int(v.accepted[0]), int(v.next_tokens[0])
