"""Rejection sampling of a drafted block in one C call (``verify.c``, in the library
`linear_lib` loads)."""

from __future__ import annotations

import torch
from torch import Tensor

from specops.kernels.linear_lib import _kernel, available, unavailable_reason


def verify_sampled(logits: Tensor, draft: list[int], q: Tensor | None, temperature: float,
                   generator: torch.Generator) -> tuple[int, int]:
    """Rejection sampling of one drafted block in one C call (``specops_verify_sampled``):
    ``logits`` [G+1, V] the target's (fp32, contiguous), ``draft`` its G drafted tokens,
    ``q`` [G, V] their draft distributions (None: a deterministic drafter), p =
    softmax(logits / temperature) (no top-k / top-p filter). Draws G float32 uniforms, then
    one float64 uniform, from ``generator``, as `verify.verify_sampling` does. Returns
    (accepted drafted tokens, the next token)."""
    if not available():
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    g, vocab = len(draft), logits.shape[-1]
    if logits.dtype != torch.float32 or logits.shape != (g + 1, vocab) or not logits.is_contiguous():
        raise ValueError(f"logits must be contiguous fp32 [{g + 1}, V], got {tuple(logits.shape)} {logits.dtype}")
    if q is not None and (q.dtype != torch.float32 or q.shape != (g, vocab) or not q.is_contiguous()):
        raise ValueError(f"q must be contiguous fp32 [{g}, {vocab}], got {tuple(q.shape)} {q.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    tokens = torch.tensor(draft, dtype=torch.int64)
    if g and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"drafted tokens must be in [0, {vocab})")
    u = torch.rand(g, generator=generator, dtype=torch.float32, device=generator.device).cpu()
    u_draw = float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device))
    out = torch.empty(2, dtype=torch.int64)
    scratch = torch.empty(2 * vocab, dtype=torch.float32)  # a row of p and its residual
    _kernel.lib.specops_verify_sampled(logits.data_ptr(), None if q is None else q.data_ptr(), tokens.data_ptr(), g,
                                       vocab, 1.0 / float(temperature), u.data_ptr(), u_draw, scratch.data_ptr(),
                                       out.data_ptr(), out[1:].data_ptr())
    return int(out[0]), int(out[1])
