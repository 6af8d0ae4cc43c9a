"""Attention on CPU over the C kernels (``attention.c``, in the library `linear_lib` loads):
T new positions per sequence over a dense cache, causal or by a tree's visibility mask, split
over the kernels' thread pool, and the fast runner's whole attention block after the q/k/v
projection (rotary, cache write, attention) in one call."""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import Tensor

from specops.kernels.linear_lib import _kernel

MAX_MASK_NODES = 64  # new positions a visibility mask (`mask_bits`) can describe


# id(mask) -> (a weak reference to it, a copy of its values then, its words); an entry goes with its tensor
_MASK_WORDS: dict[int, tuple[weakref.ref, Tensor, Tensor]] = {}


def mask_bits(mask: Tensor) -> Tensor:
    """A [T, T] bool visibility mask among new positions (``mask[t, i]``: query t sees new
    position i; a Medusa tree's ancestor mask) as the kernel's [T] words (bit i of word t).
    Kept per mask tensor (a tree's mask is built once and verified every step), and redone
    when its values changed in place (compared with a copy: inference tensors keep no version)."""
    t = mask.shape[0]
    if mask.dim() != 2 or mask.shape[1] != t or t > MAX_MASK_NODES:
        raise ValueError(f"mask must be [T, T] with T <= {MAX_MASK_NODES}, got {tuple(mask.shape)}")
    cached = _MASK_WORDS.get(id(mask))
    if cached is not None and cached[0]() is mask and torch.equal(cached[1], mask):
        return cached[2]
    weights = np.left_shift(np.uint64(1), np.arange(t, dtype=np.uint64))  # [T]
    words = (mask.cpu().numpy().astype(np.uint64) * weights[None, :]).sum(axis=1, dtype=np.uint64)  # [T]
    out = torch.from_numpy(words.view(np.int64).copy())
    key = id(mask)
    _MASK_WORDS[key] = (weakref.ref(mask, lambda _, key=key: _MASK_WORDS.pop(key, None)), mask.clone(), out)
    return out


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, out: Tensor | None = None,
                     mask: Tensor | None = None) -> Tensor:
    """Attention of T new positions per sequence over a dense cache, causal (query t sees
    the first L - T + t + 1 keys) or, with ``mask`` (`mask_bits` of a [T, T] visibility
    mask), the first L - T keys and the new ones its bits name; grouped-query heads as
    SDPA's ``enable_gqa``.

    q [B, T, Hq, D] (heads and dims contiguous, rows and sequences may be strided: a slice
    of the fused q/k/v output), k / v [B, Hkv, L, D] views with a contiguous last dim and unit stride
    between positions (the fast runner's `KVCache`). Returns [B * T, Hq * D] fp32."""
    lib = _kernel.require()
    b, t, hq, d = q.shape
    _, hkv, length, _ = k.shape
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        raise ValueError("causal_attention takes fp32 tensors")
    if q.stride(3) != 1 or q.stride(2) != d:
        raise ValueError("q's heads and dims must be contiguous")
    if k.stride() != v.stride() or k.stride(3) != 1 or k.stride(2) != d or k.shape != v.shape:
        raise ValueError("k and v must share one layout with contiguous [L, D] per head")
    if hq % hkv or length < t:
        raise ValueError(f"bad shapes: Hq={hq} Hkv={hkv} L={length} T={t}")
    _check_mask(mask, t)
    if out is None:
        out = torch.empty(b * t, hq * d, dtype=torch.float32)
    rc = lib.specops_attention(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
                                out.data_ptr(), b, t, hq, hkv, d, length, float(scale),
                                None if mask is None else mask.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU attention kernel: no memory for its scores")
    return out


def _check_mask(mask: Tensor | None, t: int) -> None:
    if mask is not None and (mask.dtype != torch.int64 or mask.shape != (t,) or not mask.is_contiguous()):
        raise ValueError(f"mask must be the [{t}] int64 words of mask_bits")


def rope_cache_attention(qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, start: int,
                         scale: float, mask: Tensor | None = None) -> Tensor:
    """The fast runner's attention block after the q/k/v projection, in one call: rotary on
    the q and k heads of ``qkv`` [B, T, Hq + 2Hkv, D] (contiguous; rotated in place), the new
    keys / values written to ``k_cache`` / ``v_cache`` [B, Hkv, S, D] at slots
    start..start+T-1, then `causal_attention` over start + T keys (causal, or by ``mask``).
    ``cos`` / ``sin`` [T, D] are the rows of the tokens' positions (``sin`` with its first
    half negated). Returns [B * T, Hq * D]."""
    lib = _kernel.require()
    b, t, heads, d = qkv.shape
    _, hkv, slots, _ = k_cache.shape
    hq = heads - 2 * hkv
    for name, tensor in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 tensor")
    if cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"cos / sin must be [{t}, {d}]")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or k_cache.stride(2) != d:
        raise ValueError("k and v caches must share one layout with contiguous [S, D] per head")
    if hq < 1 or hq % hkv or start < 0 or start + t > slots or d % 2:
        raise ValueError(f"bad shapes: heads={heads} Hkv={hkv} D={d} start={start} T={t} S={slots}")
    _check_mask(mask, t)
    out = torch.empty(b * t, hq * d, dtype=torch.float32)
    rc = lib.specops_rope_cache_attention(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                                           v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), start,
                                           out.data_ptr(), b, t, hq, hkv, d, float(scale),
                                           None if mask is None else mask.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"CPU attention kernel failed (code {rc})")
    return out
