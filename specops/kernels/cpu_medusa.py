"""Medusa proposals on CPU in one C call (``medusa.c``, in the library `linear_lib` loads):
every head's top-k token ids from the target's hidden states."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from specops.kernels.linear_lib import _kernel, weight_flags


@dataclass(frozen=True)
class MedusaWeights:
    """Medusa heads laid out for `medusa_candidates` (built once per weights by the caller):
    ``blocks`` [K][L] (panel-packed weight [E, E], fp32 bias [E]), the shared LM head's
    (shortlisted) rows packed ``lm`` [F, E] with bias or None, the shortlist's token ids
    ``ids`` [F] long or None (F = vocabulary), and ``root`` (packed [E, E]) with the base
    model's fp32 embedding [V, E] for heads that read the root token, else None. Weights may
    be bfloat16 where `bf16_weights`."""

    blocks: list[list[tuple[Tensor, Tensor]]]
    lm: Tensor
    lm_bias: Tensor | None
    ids: Tensor | None
    root: Tensor | None
    embed: Tensor | None

    def __post_init__(self) -> None:
        flat = [pair for head in self.blocks for pair in head]
        object.__setattr__(self, "_w", (ctypes.c_void_p * len(flat))(*[w.data_ptr() for w, _ in flat]))
        object.__setattr__(self, "_b", (ctypes.c_void_p * len(flat))(*[b.data_ptr() for _, b in flat]))


def medusa_candidates(weights: MedusaWeights, hidden: Tensor, num_heads: int, top_k: int,
                      roots: Tensor | None = None, threads: int | None = None) -> Tensor:
    """Each of the first ``num_heads`` heads' ``top_k`` best token ids, best first, in one C
    call (`specops_medusa_candidates`): hidden [R, E] contiguous fp32, roots [R] long (heads
    with a root projection) -> [K, R, top_k] long. The heads' blocks, the LM head over the
    shortlist and the top-k are the kernel's; a tie keeps the lower shortlist row first."""
    r, e = hidden.shape
    k, layers = num_heads, len(weights.blocks[0])
    f = weights.lm.shape[0]
    out = torch.empty(k, r, top_k, dtype=torch.long)
    root_ids = None
    if weights.root is not None:
        root_ids = roots.reshape(-1).to(torch.long).contiguous()
        if root_ids.numel() != r:
            raise ValueError(f"roots must hold {r} ids, got {root_ids.numel()}")
    rc = _kernel.lib.specops_medusa_candidates(
        hidden.data_ptr(), r, e, None if root_ids is None else root_ids.data_ptr(),
        None if weights.embed is None else weights.embed.data_ptr(),
        0 if weights.embed is None else weights.embed.shape[0],
        None if weights.root is None else weights.root.data_ptr(), 0 if weights.root is None else weight_flags(weights.root),
        weights._w, weights._b, weight_flags(weights.blocks[0][0][0]), k, layers, weights.lm.data_ptr(),
        None if weights.lm_bias is None else weights.lm_bias.data_ptr(), weight_flags(weights.lm), f,
        None if weights.ids is None else weights.ids.data_ptr(), top_k, out.data_ptr(),
        int(threads or torch.get_num_threads()))
    if rc == 3:
        raise ValueError(f"top_k must be in 1..{f} and every root id in the embedding's range")
    if rc != 0:
        raise MemoryError(f"CPU Medusa kernel failed (code {rc})")
    return out
