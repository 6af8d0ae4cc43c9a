"""Varlen attention over a paged KV store, on the GPU: one Triton kernel for every sequence of a
ragged batch, each with its own key count, query count and (optionally) a tree mask.

The serving engine's paged model (`specops.models.paged_llama.PagedLlama`) keeps every
layer's keys and values slot-major in one store, and a batch step puts each sequence's
new tokens (one for plain decoding, γ+1 for a chain draft, a Medusa tree's nodes, a
short prefill) after its cached prefix. Without a kernel, every layer gathers a padded
[G, Lk] copy of the batch's keys and values (``index_select``) and runs SDPA over it
with an explicit mask: two extra passes over the KV and a mask tensor per group. This
kernel reads each key and value in place through the sequence's slot list.

Shapes (glossary in the README; N flat new tokens, G sequences, Tq queries per sequence
padded, Lk keys per sequence padded, S store slots):

    q          # [N, Hq, D]        rows may be strided; heads and dims contiguous
    k_store    # [S, Hkv, D]       one layer's keys, contiguous (v_store alike)
    q_index    # [G, Tq] int64     flat row of sequence g's t-th query (padding: any)
    visible    # [G, Tq] int64     query t sees keys [0, visible) of its sequence; 0 = padding
    kv_slots   # [G, Lk] int64     store slot of sequence g's j-th key
    mask       # [G, Tq, Lk] bool  optional (trees): additionally, query t may see key j
    out        # [N, Hq * D]       written at the rows q_index names (padded queries: never)

Grid (G * Tq, Hkv): one program per query token and kv head, all Hq / Hkv query heads of
that kv head at once (each K/V tile is loaded once for the group), an online softmax over
blocks of ``BLOCK_N`` keys. Decode is memory-bound, so the scores are a broadcast
multiply-and-sum rather than a tensor-core dot; a verify step's γ+1 queries of one
sequence read the same keys and share them through L2. Long prefills stay on SDPA
(`PagedLlama.kernel_group`). A query row with no visible key returns zeros, as
`tree_attention` does.

Checked in Triton's CPU interpreter against `paged_attention_reference` (fp32) and compiled
for sm_90 in CI; it has not been timed on a GPU here (no GPU was lent to the sessions that
wrote it): `make gpu-check` is where its speed gets measured.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:  # pragma: no cover - the reference path works without Triton
    triton = None
    tl = None

_LOG2E = 1.4426950408889634
_NEG_BIG = -1.0e30  # finite stand-in for -inf as the running max (an all-masked block gives 0, not NaN)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def paged_attention_reference(q: Tensor, k_store: Tensor, v_store: Tensor, q_index: Tensor, visible: Tensor,
                              kv_slots: Tensor, out: Tensor, scale: float, mask: Tensor | None = None) -> None:
    """Plain PyTorch, in float32 (gather + masked softmax); writes ``out`` like the kernel."""
    g, tq = q_index.shape
    lk = kv_slots.shape[1]
    hq, d = q.shape[1], q.shape[2]
    hkv = k_store.shape[1]
    group = hq // hkv
    real = visible > 0  # [G, Tq]
    if not bool(real.any()):
        return
    qf = q.float()[q_index.reshape(-1)].view(g, tq, hkv, group, d)  # [G, Tq, Hkv, grp, D]
    k = k_store.float()[kv_slots.reshape(-1)].view(g, lk, hkv, d)  # [G, Lk, Hkv, D]
    v = v_store.float()[kv_slots.reshape(-1)].view(g, lk, hkv, d)
    scores = torch.einsum("gthcd,glhd->gthcl", qf, k) * scale  # [G, Tq, Hkv, grp, Lk]
    seen = torch.arange(lk, device=q.device)[None, None, :] < visible[:, :, None]  # [G, Tq, Lk]
    if mask is not None:
        seen = seen & mask.to(torch.bool)
    scores = scores.masked_fill(~seen[:, :, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    o = torch.einsum("gthcl,glhd->gthcd", weights, v).reshape(g, tq, hq * d)  # [G, Tq, Hq*D]
    rows = q_index[real]
    out[rows] = o[real].to(out.dtype)


if triton is not None:
    _NEG_BIG_C = tl.constexpr(_NEG_BIG)

    @triton.jit
    def _paged_attn_kernel(
        Q, K, V, O, QIDX, VIS, SLOTS, MASK,
        stride_qn, stride_qh,  # q [N, Hq, D]: row and head strides (dims contiguous)
        stride_ks, stride_kh,  # k/v store [S, Hkv, D]: slot and head strides
        stride_on,  # out [N, Hq*D]
        tq, lk, qk_scale,  # queries and keys per sequence (padded), scale * log2(e)
        GROUP: tl.constexpr,  # query heads per kv head
        GROUP_P: tl.constexpr,  # next_pow2(GROUP)
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,  # next_pow2(HEAD_DIM)
        BLOCK_N: tl.constexpr,  # keys per step
        HAS_MASK: tl.constexpr,
    ):
        pid = tl.program_id(0)  # g * tq + t
        h_kv = tl.program_id(1).to(tl.int64)
        g = pid // tq
        vis = tl.load(VIS + pid)
        if vis > 0:  # padded queries write nothing (their q_index may name another token's row)
            row = tl.load(QIDX + pid).to(tl.int64)
            heads = tl.arange(0, GROUP_P)
            head_ok = heads < GROUP
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            h_q = h_kv * GROUP + heads
            q = tl.load(Q + row * stride_qn + h_q[:, None] * stride_qh + d[None, :],
                        mask=head_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [GP, BD]
            m = tl.full([GROUP_P], _NEG_BIG_C, tl.float32)
            l_sum = tl.zeros([GROUP_P], tl.float32)
            acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
            for start in range(0, vis, BLOCK_N):
                j = start + tl.arange(0, BLOCK_N)
                key_ok = j < vis
                if HAS_MASK:
                    allowed = tl.load(MASK + pid.to(tl.int64) * lk + j, mask=key_ok, other=0)
                    key_ok = key_ok & (allowed != 0)
                slot = tl.load(SLOTS + g.to(tl.int64) * lk + j, mask=key_ok, other=0).to(tl.int64)
                kv_off = slot[:, None] * stride_ks + h_kv * stride_kh + d[None, :]  # [BN, BD]
                kv_ok = key_ok[:, None] & d_ok[None, :]
                k = tl.load(K + kv_off, mask=kv_ok, other=0.0).to(tl.float32)  # [BN, BD]
                s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * qk_scale  # [GP, BN], log2 units
                s = tl.where(key_ok[None, :], s, _NEG_BIG_C)
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new[:, None])
                p = tl.where(key_ok[None, :], p, 0.0)
                v = tl.load(V + kv_off, mask=kv_ok, other=0.0).to(tl.float32)  # [BN, BD]
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
                l_sum = l_sum * alpha + tl.sum(p, axis=1)
                m = m_new
            o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            tl.store(O + row * stride_on + h_q[:, None] * HEAD_DIM + d[None, :], o.to(O.dtype.element_ty),
                     mask=head_ok[:, None] & d_ok[None, :])


def triton_available() -> bool:
    return triton is not None


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def block_n_for(head_dim: int, group: int) -> int:
    """Keys per step: the [GROUP_P, BLOCK_N, BLOCK_D] product stays ~8K elements (registers)."""
    return max(16, min(64, 8192 // (_next_pow2(group) * _next_pow2(head_dim))))


def kernel_constexprs(hq: int, hkv: int, head_dim: int, has_mask: bool) -> dict:
    """The compile-time arguments of ``_paged_attn_kernel`` for one layer shape."""
    group = hq // hkv
    return dict(GROUP=group, GROUP_P=_next_pow2(group), HEAD_DIM=head_dim, BLOCK_D=_next_pow2(head_dim),
                BLOCK_N=block_n_for(head_dim, group), HAS_MASK=has_mask)


def paged_attention(q: Tensor, k_store: Tensor, v_store: Tensor, q_index: Tensor, visible: Tensor,
                    kv_slots: Tensor, out: Tensor, scale: float, mask: Tensor | None = None,
                    impl: str = "auto") -> None:
    """Write each real query's attention output into ``out`` (shapes in the module docstring).

    ``impl``: "triton" (CUDA tensors, or any under TRITON_INTERPRET=1), "torch" (the
    reference), "auto" (Triton on CUDA when it is installed, else the reference)."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    n, hq, d = q.shape
    s, hkv, dk = k_store.shape
    if dk != d or tuple(v_store.shape) != tuple(k_store.shape):
        raise ValueError(f"k_store / v_store must be [S, Hkv, {d}] alike, got {list(k_store.shape)} / "
                         f"{list(v_store.shape)}")
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if q_index.shape != visible.shape or q_index.dim() != 2 or kv_slots.dim() != 2 \
            or kv_slots.shape[0] != q_index.shape[0]:
        raise ValueError(f"q_index / visible must be [G, Tq] and kv_slots [G, Lk], got {list(q_index.shape)}, "
                         f"{list(visible.shape)}, {list(kv_slots.shape)}")
    g, tq = q_index.shape
    lk = kv_slots.shape[1]
    if mask is not None and tuple(mask.shape) != (g, tq, lk):
        raise ValueError(f"mask must be [{g}, {tq}, {lk}], got {list(mask.shape)}")
    if tuple(out.shape) != (n, hq * d):
        raise ValueError(f"out must be [{n}, {hq * d}], got {list(out.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or k_store.dtype != q.dtype or v_store.dtype != q.dtype:
        raise ValueError(f"q, k_store and v_store must share one of {SUPPORTED_DTYPES}, got {q.dtype}, "
                         f"{k_store.dtype}, {v_store.dtype}")
    use_triton = impl == "triton" or (impl == "auto" and triton is not None and q.is_cuda)
    if not use_triton:
        paged_attention_reference(q, k_store, v_store, q_index, visible, kv_slots, out, scale, mask)
        return
    if triton is None:
        raise RuntimeError("impl='triton' needs the triton package")
    if q.stride(2) != 1 or q.stride(1) != d or not k_store.is_contiguous() or not v_store.is_contiguous() \
            or not out.is_contiguous():
        raise ValueError("q's heads and dims must be contiguous within a row; k_store, v_store and out contiguous")
    if g * tq == 0:
        return
    if lk == 0:
        visible = torch.zeros_like(visible)  # nothing to see: every row is padding
        kv_slots = torch.zeros((g, 1), dtype=torch.int64, device=q.device)
        lk = 1
    mask_arg = mask.to(torch.uint8).contiguous() if mask is not None else visible  # unread when HAS_MASK is off
    _paged_attn_kernel[(g * tq, hkv)](
        q, k_store, v_store, out, q_index.contiguous(), visible.contiguous(), kv_slots.contiguous(), mask_arg,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1), out.stride(0),
        tq, lk, float(scale) * _LOG2E,
        **kernel_constexprs(hq, hkv, d, mask is not None), num_warps=4,
    )
