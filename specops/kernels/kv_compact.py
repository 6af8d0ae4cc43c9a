"""KV compaction: move the accepted tree path's cache rows into contiguous slots.

After tree verification the cache holds the prefix (length ``start``) followed by
all T tree nodes; only the accepted root-to-leaf path survives. ``keep`` lists the
accepted nodes' offsets from ``start`` in increasing order; row ``start + keep[i]``
moves to row ``start + i`` (then the caller sets its cache length to
``start + len(keep)``).

Cache layout: ``[B, Hkv, Lmax, D]`` (batch, kv heads, cache positions, head dim),
addressed through strides, so any layout whose last dimension (D) is contiguous
works as a view with that dimension order, e.g. a ``[B, Lmax, Hkv, D]`` buffer
passed as ``buf.transpose(1, 2)``.

Overlap: because ``keep`` is strictly increasing with ``keep[0] >= 0`` we have
``keep[i] >= i``, so a destination row ``start + i`` may be the source of an
*earlier* entry ``j < i`` (``keep[j] == i``) but never of a later one. Copying
rows one by one in increasing order is therefore safe; copying them in parallel is
not. The Triton kernel gives each program a full column strip (one batch, one kv
head, a slice of D) of every kept row, loads a block of rows into registers,
synchronises the program's threads, then writes them, block by block in
increasing order.

Why the runtime does not call it: `specops.models.kv_cache.KVCache.compact` keeps all
layers' keys and values in one tensor ``[NL, 2, B, Hkv, S, D]`` and compacts every layer
at once with one ``index_select`` and one copy — two launches per verification step,
whatever the depth. This kernel works on one (k, v) pair of ``[B, Hkv, Lmax, D]`` caches,
so the runtime would launch it once per layer (``NL`` launches); the path it moves is
at most a few rows (≤ tree depth + 1), where launch count, not bandwidth, sets the cost.
It stays the reference for a per-layer paged cache (the serving engine's layout), and
`specops bench kernels` measures its bandwidth on a GPU.

This file holds, in order: the PyTorch reference, the Triton kernel and the
checked wrapper ``kv_compact``.
"""

from __future__ import annotations

import torch

from specops.kernels.tree_attention import IMPLS, triton_interpreting

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:  # pragma: no cover - the reference path works without Triton
    triton = None
    tl = None


# --------------------------------------------------------------------------- reference


def kv_compact_reference(
    k_cache: torch.Tensor,  # [B, Hkv, Lmax, D], modified in place
    v_cache: torch.Tensor,  # [B, Hkv, Lmax, D], modified in place
    start: int,
    keep: torch.Tensor,  # [n] long, strictly increasing offsets from start
) -> None:
    """Plain PyTorch compaction (gathers a copy first, so overlap is harmless)."""
    n = keep.numel()
    if n == 0:
        return
    src = keep.to(device=k_cache.device, dtype=torch.long) + start  # [n]
    for cache in (k_cache, v_cache):
        rows = cache.index_select(2, src)  # [B, Hkv, n, D] (a copy)
        cache[:, :, start : start + n].copy_(rows)


# --------------------------------------------------------------------------- Triton kernel

if triton is not None:

    @triton.jit
    def _kv_compact_kernel(
        K, V,  # [B, Hkv, Lmax, D], in place
        KEEP,  # [n] int64
        stride_kb, stride_kh, stride_kl,
        stride_vb, stride_vh, stride_vl,
        heads_kv, start, n_keep,
        HEAD_DIM: tl.constexpr,
        BLOCK_R: tl.constexpr,  # kept rows per step
        BLOCK_D: tl.constexpr,  # head-dim slice per program
    ):
        """One program: one (batch, kv head) and one BLOCK_D slice of D, all kept rows."""
        pid_bh = tl.program_id(0)
        pid_d = tl.program_id(1)
        b = (pid_bh // heads_kv).to(tl.int64)  # 64-bit offsets: caches can exceed 2**31 elements
        h = (pid_bh % heads_kv).to(tl.int64)
        d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        if HEAD_DIM % BLOCK_D == 0:  # no padding: an all-true mask folds away, loads stay vectorised
            d_ok = tl.full([BLOCK_D], 1, tl.int1)
        else:
            d_ok = d < HEAD_DIM
        k_base = K + b * stride_kb + h * stride_kh
        v_base = V + b * stride_vb + h * stride_vh
        for r0 in range(0, n_keep, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_ok = r < n_keep
            ok = r_ok[:, None] & d_ok[None, :]
            src = start + tl.load(KEEP + r, mask=r_ok, other=0)  # [BLOCK_R]
            dst = start + r
            k_rows = tl.load(k_base + src[:, None] * stride_kl + d[None, :], mask=ok)  # [BLOCK_R, BLOCK_D]
            v_rows = tl.load(v_base + src[:, None] * stride_vl + d[None, :], mask=ok)
            # every thread's reads of this block land before any thread overwrites a
            # row that an earlier entry of the same block still had to read
            tl.debug_barrier()
            tl.store(k_base + dst[:, None] * stride_kl + d[None, :], k_rows, mask=ok)
            tl.store(v_base + dst[:, None] * stride_vl + d[None, :], v_rows, mask=ok)


# --------------------------------------------------------------------------- wrapper


def _validate(k_cache, v_cache, start, keep, impl) -> list[int]:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("keep", keep)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [B, Hkv, Lmax, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"k_cache is on {k_cache.device} but v_cache is on {v_cache.device}")
    if keep.dim() != 1:
        raise ValueError(f"keep must be 1-D, got shape {tuple(keep.shape)}")
    if keep.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"keep must be an int64 or int32 tensor, got {keep.dtype}")
    if isinstance(start, bool) or not isinstance(start, int):
        raise TypeError(f"start must be an int, got {type(start).__name__}")
    capacity = k_cache.shape[2]
    if start < 0 or start > capacity:
        raise ValueError(f"start must be in [0, {capacity}], got {start}")
    offsets = keep.tolist()
    if offsets:
        if offsets[0] < 0:
            raise ValueError(f"keep offsets must be >= 0, got {offsets[0]}")
        for i in range(1, len(offsets)):
            if offsets[i] <= offsets[i - 1]:
                raise ValueError(f"keep must be strictly increasing, got {offsets[i - 1]} then {offsets[i]} at {i}")
        if start + offsets[-1] >= capacity:
            raise ValueError(f"row start + keep[-1] = {start + offsets[-1]} is outside the cache (Lmax = {capacity})")
    return offsets


def kv_compact(
    k_cache: torch.Tensor,  # [B, Hkv, Lmax, D], modified in place
    v_cache: torch.Tensor,  # [B, Hkv, Lmax, D], modified in place
    start: int,
    keep: torch.Tensor,  # [n] int64/int32, strictly increasing offsets from start
    impl: str = "auto",
) -> None:
    """Move cache rows ``start + keep[i]`` to ``start + i`` in both caches, in place.

    ``impl``: ``"auto"`` (Triton for CUDA caches, the reference otherwise),
    ``"triton"`` or ``"torch"``. Rows past ``start + len(keep)`` are left as they
    were; the caller shortens its cache length. ``keep`` is checked on the host
    (strictly increasing, inside the cache), which synchronises a CUDA ``keep``.
    """
    offsets = _validate(k_cache, v_cache, start, keep, impl)
    if not offsets or offsets == list(range(len(offsets))):
        return  # nothing moves
    use_triton = impl == "triton" or (impl == "auto" and k_cache.is_cuda and triton is not None)
    if not use_triton:
        kv_compact_reference(k_cache, v_cache, start, keep)
        return
    if triton is None:
        raise ValueError("impl='triton' needs the triton package (pip install specops[kernels])")
    if not k_cache.is_cuda and not triton_interpreting():
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got device {k_cache.device}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension, got strides {x.stride()}")
    if k_cache.is_cuda:
        with torch.cuda.device(k_cache.device):  # Triton launches on the current device's stream
            _launch(k_cache, v_cache, start, keep, len(offsets))
    else:
        _launch(k_cache, v_cache, start, keep, len(offsets))


def _launch(k_cache, v_cache, start, keep, n_keep):
    batch, heads_kv, _, head_dim = k_cache.shape
    keep_dev = keep.to(device=k_cache.device, dtype=torch.int64).contiguous()  # [n]
    block_d = min(128, max(16, 1 << (head_dim - 1).bit_length()))
    block_r = min(64, max(16, 1 << (n_keep - 1).bit_length()))
    grid = (batch * heads_kv, -(-head_dim // block_d))
    _kv_compact_kernel[grid](
        k_cache, v_cache, keep_dev,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        heads_kv, start, n_keep,
        HEAD_DIM=head_dim,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=4,
    )
