"""Paged attention on CPU without the gather: a small C kernel (``paged_attention.c``) that
reads keys and values in place from the slot-major KV store.

Why: a batched decode step over a paged cache otherwise copies every sequence's keys and
values into a padded tensor (``index_select``) and then runs SDPA over the copy; at batch
16 with ~250-token contexts that is two passes over ~3 MB per layer plus the copy's
writes, and it was the largest cost of the step after the matmuls. The kernel reads
each key/value once per kv head (for every query head that shares it).

Loaded on first use (`specops.kernels.cbuild`): the prebuilt variant for this CPU where an
image ships one, else built with the system C compiler (``$CC`` or ``cc``; ``-O3
-march=native``, reassociation, like torch's own CPU kernels are tuned to the machine) into
``$SPECOPS_CACHE_DIR`` (default ``~/.cache/specops``), keyed by the compiler's target
features, the sources and the flags, and loaded with ctypes, which releases the GIL during
the call (`loaded_from` says which). Neither, or a build that fails: `available()` is False,
the reason is logged once, and callers keep the SDPA path — never an error.
``SPECOPS_CPU_KERNELS=0`` turns it off.

Supported: fp32 CPU tensors, masks of the form "query t sees the first visible[g, t] keys"
(plain decoding, prefills, chain drafts). Trees keep SDPA.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from specops.kernels.cbuild import LazyKernel

SOURCE = Path(__file__).with_name("paged_attention.c")


def _setup(lib: ctypes.CDLL) -> None:
    fn = lib.specops_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8 + [ctypes.c_float]


_kernel = LazyKernel(SOURCE, "paged_attention", _setup, "CPU paged-attention kernel", "SDPA over gathered KV")


available = _kernel.available  # whether the kernel is built and loaded (builds it on the first call)
unavailable_reason = _kernel.unavailable_reason  # why not (None when it is)
loaded_from = _kernel.loaded_from  # "prebuilt <variant>: <path>" or "built: <path>" (None: not loaded)


def paged_attention(q: Tensor, k_store: Tensor, v_store: Tensor, q_index: Tensor, visible: Tensor,
                    kv_slots: Tensor, out: Tensor, scale: float, threads: int | None = None) -> None:
    """Write attention outputs into ``out`` [N, Hq*D] at the rows ``q_index`` [G, Tq] names.

    q [N, Hq, D] (rows may be strided, heads and dims contiguous), k_store / v_store
    [S, Hkv, D] contiguous, visible [G, Tq] int64 (keys each query sees, 0 = padded query),
    kv_slots [G, Lk] int64. All fp32 on CPU. ``threads``: workers sharing the queries
    (default: torch's intra-op thread count; small calls stay on one).
    """
    lib = _kernel.require()
    n, hq, d = q.shape
    hkv = k_store.shape[1]
    if q.dtype != torch.float32 or k_store.dtype != torch.float32 or out.dtype != torch.float32:
        raise ValueError("the CPU paged-attention kernel takes fp32 tensors")
    if q.stride(2) != 1 or q.stride(1) != d:
        raise ValueError("q's heads and dims must be contiguous within a row")
    for name, t in (("k_store", k_store), ("v_store", v_store), ("out", out)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    g, tq = q_index.shape
    lk = kv_slots.shape[1]
    q_index = q_index.contiguous()
    visible = visible.contiguous()
    kv_slots = kv_slots.contiguous()
    rc = lib.specops_paged_attention(q.data_ptr(), k_store.data_ptr(), v_store.data_ptr(), q_index.data_ptr(),
                                      visible.data_ptr(), kv_slots.data_ptr(), out.data_ptr(), g, tq, lk, hq, hkv, d,
                                      q.stride(0), int(threads or torch.get_num_threads()), float(scale))
    if rc != 0:
        raise ValueError(f"CPU paged-attention kernel refused the shapes (code {rc}): Hq={hq} Hkv={hkv}")


class PreparedCall:
    """`paged_attention` for one batch's attention group, with everything that is the same for
    every layer (index tensors, shapes, scale, thread count) checked and converted once: a
    forward calls the kernel once per layer, and the per-call checks and argument conversion
    cost about as much as the kernel itself at batch 1. Call with the layer's q [N, Hq, D]
    (row stride ``q_stride``), its key/value store pointers and the output tensor [N, Hq*D]."""

    __slots__ = ("_fn", "_mid", "_tail", "_keep", "n", "q_stride")

    def __init__(self, q_index: Tensor, visible: Tensor, kv_slots: Tensor, *, n: int, hq: int, hkv: int, d: int,
                 q_stride: int, scale: float, threads: int | None = None) -> None:
        lib = _kernel.require()
        if hkv <= 0 or hq % hkv:
            raise ValueError(f"CPU paged-attention kernel refused the shapes (code 1): Hq={hq} Hkv={hkv}")
        q_index, visible, kv_slots = q_index.contiguous(), visible.contiguous(), kv_slots.contiguous()
        g, tq = q_index.shape
        self._fn = lib.specops_paged_attention
        self._keep = (q_index, visible, kv_slots)  # the pointers below stay valid while this lives
        self._mid = (q_index.data_ptr(), visible.data_ptr(), kv_slots.data_ptr())
        self._tail = (g, tq, kv_slots.shape[1], hq, hkv, d, q_stride, int(threads or torch.get_num_threads()),
                      float(scale))
        self.n = n
        self.q_stride = q_stride

    def __call__(self, q_ptr: int, k_ptr: int, v_ptr: int, out: Tensor) -> None:
        rc = self._fn(q_ptr, k_ptr, v_ptr, *self._mid, out.data_ptr(), *self._tail)
        if rc != 0:
            raise ValueError(f"CPU paged-attention kernel failed (code {rc})")
