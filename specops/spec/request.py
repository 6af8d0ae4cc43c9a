"""One request's inputs and how it ends, shared by every decoding method.

Validation of what a caller passes (the prompt, EOS ids, a deadline) and the
context-window budget, raising `InvalidRequestError` / `ContextLengthError`; the EOS
cut of emitted tokens and the stop reason a request reports.
"""

from __future__ import annotations

import torch

from specops.spec.errors import ContextLengthError, InvalidRequestError


def prompt_list(prompt_ids: torch.Tensor) -> list[int]:  # prompt_ids: [B, T] long, B == 1
    """The single sequence of a [1, T] prompt as Python ints."""
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        raise InvalidRequestError(f"prompt_ids must be a non-empty [B, T] tensor, got shape {tuple(prompt_ids.shape)}")
    if prompt_ids.shape[0] != 1:
        raise InvalidRequestError(f"batch size {prompt_ids.shape[0]} is not supported yet; decode one sequence (B = 1)")
    return [int(t) for t in prompt_ids[0].tolist()]


def eos_set(eos_token_id: int | list[int] | tuple[int, ...] | None) -> frozenset[int]:
    """EOS ids as a set (empty = never stop early)."""
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise InvalidRequestError(f"eos_token_id must be a non-negative int or a list of them, got {eos_token_id!r}")
    return frozenset(ids)


def check_room(prompt_len: int, limit: int, max_new_tokens: int) -> int:
    """The output budget of a request: ``max_new_tokens`` clamped to the context window of
    ``limit`` positions; `ContextLengthError` when the prompt leaves no room."""
    if prompt_len >= limit:
        raise ContextLengthError(
            f"prompt of {prompt_len} tokens leaves no room in the model's context of {limit} positions"
        )
    return min(max_new_tokens, limit - prompt_len)


def check_deadline(deadline_s: float) -> float:
    """Validate a decode deadline in seconds (> 0)."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
        raise InvalidRequestError(f"deadline_s must be a number of seconds > 0 or None, got {deadline_s!r}")
    return float(deadline_s)


def eos_cut(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first EOS (all of them when none is there)."""
    for k, tok in enumerate(tokens):
        if tok in eos:
            return tokens[: k + 1]
    return tokens


def stop_reason(stopped_by_eos: bool, budget: int, max_new_tokens: int) -> str:
    """Why a request ended: ``eos``, else ``context`` when the context window cut the budget,
    else ``max_new_tokens``."""
    if stopped_by_eos:
        return "eos"
    return "context" if budget < max_new_tokens else "max_new_tokens"
