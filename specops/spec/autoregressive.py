"""Plain autoregressive decoding with a KV cache: one target forward per new token.

This is the baseline every speculative method must reproduce (token for token when
greedy, in distribution when sampling) and the fallback when speculation is off.
"""

from __future__ import annotations

import torch

from specops.spec.errors import InvalidRequestError
from specops.models.runner import ModelRunner, prompt_forward
from specops.spec.sampling import SamplingConfig, next_token
from specops.spec.clock import device_clock
from specops.spec.request import check_room, eos_set, prompt_list, stop_reason
from specops.spec.stats import DecodeStats


def generate_ar(
    target: ModelRunner,
    prompt_ids: torch.Tensor,  # [B, T] long, B == 1
    *,
    sampling: SamplingConfig,
    generator: torch.Generator,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    method: str = "ar",
) -> tuple[list[int], DecodeStats]:
    """Decode up to ``max_new_tokens`` tokens; stop after an EOS token (which is kept).

    ``method`` names the stats (a fallback from another method reports ``ar``).
    Also measures the single-token forward time (``stats.plain_token_s``).
    """
    if max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompt = prompt_list(prompt_ids)
    eos = eos_set(eos_token_id)
    budget = check_room(len(prompt), target.max_context, max_new_tokens)
    stats = DecodeStats(method=method)
    device = target.device
    stats.start()
    target.reset(1)

    t0 = device_clock(device)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, P]
    first = prompt_forward(target, ids)
    out = [first.last_choice() if sampling.greedy else int(next_token(first.logits[:, -1], sampling, generator)[0])]
    dt = device_clock(device) - t0
    stats.target_forwards += 1
    stats.verify_s += dt
    stats.prefill_s += dt
    stats.record_emitted(1)

    step_s = 0.0
    # greedy on the fast runner: each step's forward and argmax in one C call (`FastLlamaRunner.block_verifier`:
    # the same C forward `forward` runs, without the Python around it)
    make = getattr(target, "block_verifier", None) if sampling.greedy else None
    block = make() if make is not None else None
    while len(out) < budget and out[-1] not in eos:
        t0 = device_clock(device)
        if block is not None and block.applies(1):
            out.append(block.verify([out[-1]])[1])
        else:
            step = target.forward(torch.tensor([[out[-1]]], dtype=torch.long, device=device))
            # greedy: the runner's argmax of the row (`RunnerOutput.last_choice`: the fast runner's C call made it)
            out.append(step.last_choice() if sampling.greedy else
                       int(next_token(step.logits[:, -1], sampling, generator)[0]))
        dt = device_clock(device) - t0
        step_s += dt
        stats.steps += 1
        stats.target_forwards += 1
        stats.verify_s += dt
        stats.record_emitted(1)

    if stats.steps:
        stats.plain_token_s = step_s / stats.steps
    stats.finish(stop_reason(out[-1] in eos, budget, max_new_tokens))
    return out, stats
