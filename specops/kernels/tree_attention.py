"""Tree attention: T tree nodes attend a long KV prefix plus their own ancestors.

Used by Medusa-style tree verification (Cai et al. 2024, arXiv 2401.10774): the
candidate tree is flattened into T positions appended after the cached prefix of
length L; node i sees every prefix entry and, among the tree nodes, only those j
with ``tree_mask[i, j]`` (its ancestors and itself).

Shapes (glossary in the README): B batch, Hq query heads, Hkv key/value heads
(Hq a multiple of Hkv, grouped-query attention), T tree nodes, L prefix length,
D head dim.

    q          # [B, Hq, T, D]
    k, v       # [B, Hkv, L + T, D]   prefix entries first, then the T tree nodes
    tree_mask  # [T, T] bool          True where node i may attend node j
    o          # [B, Hq, T, D]        same dtype as q

This file holds, in order: the plain PyTorch reference, the Triton kernels and the
checked wrapper ``tree_attention``. The Triton path is flash-decoding style:

1. split pass, grid (T blocks, S splits, B * Hkv): each program takes one kv head,
   all G = Hq / Hkv query heads of it for a block of tree nodes (so each K/V tile is
   loaded once for the whole group and fed to one tensor-core dot), and one slice of
   the prefix; the last slice also covers the T tree keys under the mask. It writes
   the partial softmax state (running max m, sum l, unnormalised acc) per split.
   The tree-block index varies fastest, so programs reading the same K/V slice run
   side by side and share it through L2.
2. reduce pass, grid (T blocks, B * Hq): merges the S partial states per row.
   With S == 1 the split pass writes the normalised output itself.

A query row with no visible key at all (L == 0 and an all-False mask row) has an
empty softmax; both implementations return zeros for it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:  # pragma: no cover - the reference path works without Triton
    triton = None
    tl = None

MAX_TREE_NODES = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
IMPLS = ("auto", "triton", "torch")
_LOG2E = 1.4426950408889634
# Finite stand-in for -inf as the running max, so a block whose keys are all masked
# gives exp2(-inf - NEG_BIG) = 0 instead of NaN.
_NEG_BIG = -1.0e30


# --------------------------------------------------------------------------- reference


def tree_attention_reference(
    q: torch.Tensor,  # [B, Hq, T, D]
    k: torch.Tensor,  # [B, Hkv, L + T, D]
    v: torch.Tensor,  # [B, Hkv, L + T, D]
    tree_mask: torch.Tensor,  # [T, T] bool
    scale: float,
) -> torch.Tensor:  # [B, Hq, T, D]
    """Plain PyTorch tree attention, computed in float32. Inputs are not validated."""
    batch, heads_q, nodes, head_dim = q.shape
    heads_kv, total = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    prefix = total - nodes
    qf = q.float().reshape(batch, heads_kv, group * nodes, head_dim)  # [B, Hkv, G*T, D]
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # [B, Hkv, G*T, L+T]
    visible = torch.cat(
        [torch.ones(nodes, prefix, dtype=torch.bool, device=q.device), tree_mask.to(torch.bool)], dim=1
    )  # [T, L+T]
    visible = visible.repeat(group, 1)  # [G*T, L+T]
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # [B, Hkv, G*T, L+T]; empty rows -> 0
    out = torch.matmul(weights, v.float())  # [B, Hkv, G*T, D]
    return out.reshape(batch, heads_q, nodes, head_dim).to(q.dtype)


# --------------------------------------------------------------------------- Triton kernels

if triton is not None:
    _NEG_BIG_C = tl.constexpr(_NEG_BIG)

    @triton.jit
    def _tree_attn_split_kernel(
        Q, K, V, MASK,  # q [B, Hq, T, D], k/v [B, Hkv, L+T, D], mask [T, T] uint8
        M_OUT, L_OUT, ACC_OUT,  # partials: m, l [B, Hq, S, T] f32, acc [B, Hq, S, T, D] f32
        O,  # [B, Hq, T, D], written directly when WRITE_FINAL (S == 1)
        stride_qb, stride_qh, stride_qt,
        stride_kb, stride_kh, stride_kl,
        stride_vb, stride_vh, stride_vl,
        stride_ob, stride_oh, stride_ot,
        stride_mask,
        heads_kv, prefix_len, n_nodes, chunk_len, n_splits, qk_scale,
        GROUP: tl.constexpr,  # query heads per kv head
        BLOCK_T: tl.constexpr,  # tree nodes per program
        BLOCK_M: tl.constexpr,  # query rows per program = next_pow2(GROUP) * BLOCK_T
        BLOCK_N: tl.constexpr,  # keys per inner step
        BLOCK_D: tl.constexpr,  # next_pow2(HEAD_DIM), >= 16
        HEAD_DIM: tl.constexpr,
        UPCAST: tl.constexpr,  # convert loaded tiles to f32 before the dots
        DOT_PRECISION: tl.constexpr,  # "ieee" for f32 inputs (no tf32 rounding)
        WRITE_FINAL: tl.constexpr,
    ):
        """One program: one (batch, kv head), BLOCK_T tree nodes x all GROUP query heads of
        that kv head (K/V tiles loaded once for the whole group), one slice of the prefix.
        The last split also covers the T tree-node keys under the tree mask."""
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_bh = tl.program_id(2)
        b = (pid_bh // heads_kv).to(tl.int64)  # 64-bit offsets: caches can exceed 2**31 elements
        h_kv = (pid_bh % heads_kv).to(tl.int64)

        rows = tl.arange(0, BLOCK_M)
        g = rows // BLOCK_T  # group member (query head within the kv group)
        t = pid_t * BLOCK_T + rows % BLOCK_T  # tree node
        row_ok = (g < GROUP) & (t < n_nodes)
        h_q = h_kv * GROUP + g
        d = tl.arange(0, BLOCK_D)
        if BLOCK_D == HEAD_DIM:  # no padding: an all-true mask folds away, loads stay vectorised
            d_ok = tl.full([BLOCK_D], 1, tl.int1)
        else:
            d_ok = d < HEAD_DIM

        q_ptrs = Q + b * stride_qb + h_q[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], _NEG_BIG_C, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        k_base = K + b * stride_kb + h_kv * stride_kh
        v_base = V + b * stride_vb + h_kv * stride_vh

        # ---- prefix keys [start, end): visible to every node
        start = pid_s * chunk_len
        end = tl.minimum(start + chunk_len, prefix_len)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            kt = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            vt = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            qk = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            qk = tl.where(n_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
            m_i = m_new

        # ---- tree-node keys [L, L+T): only the last split, under the tree mask
        tree_end = tl.where(pid_s == n_splits - 1, n_nodes, 0)
        for n0 in range(0, tree_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < n_nodes
            kv_row = prefix_len + n
            kt = tl.load(k_base + kv_row[:, None] * stride_kl + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            vt = tl.load(v_base + kv_row[:, None] * stride_vl + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            allowed = tl.load(
                MASK + t[:, None] * stride_mask + n[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0
            )  # [BLOCK_M, BLOCK_N]
            qk = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION) * qk_scale
            qk = tl.where(allowed != 0, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
            m_i = m_new

        if WRITE_FINAL:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            o_ptrs = O + b * stride_ob + h_q[:, None] * stride_oh + t[:, None] * stride_ot + d[None, :]
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            heads_q = heads_kv * GROUP
            part = ((b * heads_q + h_q) * n_splits + pid_s) * n_nodes + t  # [BLOCK_M]
            tl.store(M_OUT + part, m_i, mask=row_ok)
            tl.store(L_OUT + part, l_i, mask=row_ok)
            tl.store(ACC_OUT + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _tree_attn_reduce_kernel(
        M_IN, L_IN, ACC_IN,  # m, l [B, Hq, S, T] f32, acc [B, Hq, S, T, D] f32
        O,  # [B, Hq, T, D]
        stride_ob, stride_oh, stride_ot,
        heads_q, n_nodes, n_splits,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        """Merge the S partial softmax states of BLOCK_T rows of one (batch, query head)."""
        pid_t = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // heads_q).to(tl.int64)
        h_q = (pid_bh % heads_q).to(tl.int64)
        t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < n_nodes
        d = tl.arange(0, BLOCK_D)
        if BLOCK_D == HEAD_DIM:  # no padding: an all-true mask folds away, loads stay vectorised
            d_ok = tl.full([BLOCK_D], 1, tl.int1)
        else:
            d_ok = d < HEAD_DIM

        m_tot = tl.full([BLOCK_T], _NEG_BIG_C, dtype=tl.float32)
        l_tot = tl.zeros([BLOCK_T], dtype=tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for s in range(0, n_splits):
            part = (pid_bh.to(tl.int64) * n_splits + s) * n_nodes + t  # [BLOCK_T]
            m_s = tl.load(M_IN + part, mask=t_ok, other=_NEG_BIG_C)
            l_s = tl.load(L_IN + part, mask=t_ok, other=0.0)
            acc_s = tl.load(ACC_IN + part[:, None] * HEAD_DIM + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            m_new = tl.maximum(m_tot, m_s)
            w_old = tl.exp2(m_tot - m_new)
            w_s = tl.exp2(m_s - m_new)
            l_tot = l_tot * w_old + l_s * w_s
            acc = acc * w_old[:, None] + acc_s * w_s[:, None]
            m_tot = m_new

        out = acc / tl.where(l_tot > 0.0, l_tot, 1.0)[:, None]
        o_ptrs = O + b * stride_ob + h_q * stride_oh + t[:, None] * stride_ot + d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------- wrapper


@dataclass(frozen=True)
class TreeAttentionLaunch:
    """Tiling of one Triton tree-attention call (chosen by ``plan_launch``)."""

    block_t: int  # tree nodes per program
    block_m: int  # query rows per program (next_pow2(group) * block_t)
    block_n: int  # keys per inner step
    block_d: int  # padded head dim
    num_splits: int  # prefix slices (S); the last one also covers the tree keys
    chunk_len: int  # prefix keys per slice, a multiple of block_n
    num_warps: int
    num_stages: int


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_launch(
    batch: int,
    heads_kv: int,
    group: int,
    nodes: int,
    prefix: int,
    head_dim: int,
    *,
    sm_count: int,
    elem_bytes: int = 2,
    num_splits: int | None = None,
) -> TreeAttentionLaunch:
    """Pick block sizes and the number of prefix splits.

    16-bit inputs: up to 128 query rows per program (8 warps, tensor-core dots),
    64-key steps, 3 pipeline stages for D <= 128 (about 136 KiB of shared memory and
    no register spills on sm_90 at D=128). float32 inputs use exact (non-tf32) dots,
    which need far more registers: at most 64 rows, 32-key steps, 2 stages.
    Splits are added until the grid holds about two waves of programs on ``sm_count``
    SMs, but each split keeps >= 4 key blocks, and the partial-state traffic
    (S * G * T rows of D floats per kv head) stays under about half the K/V bytes.
    """
    fp32 = elem_bytes >= 4
    group_p2 = _next_pow2(group)
    block_d = max(16, _next_pow2(head_dim))
    if fp32:
        block_n = 32 if block_d <= 128 else 16
    else:
        block_n = 64 if block_d <= 128 else 32
    block_m = min(64 if fp32 else 128, max(16, group_p2 * _next_pow2(nodes)))
    block_m = max(block_m, group_p2)
    block_t = block_m // group_p2
    t_blocks = -(-nodes // block_t)
    if num_splits is None:
        target = -(-2 * sm_count // max(1, t_blocks * batch * heads_kv))
        by_length = -(-prefix // (4 * block_n))
        by_traffic = prefix // (2 * group * nodes)
        num_splits = max(1, min(target, by_length, by_traffic))
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    chunk = -(-max(prefix, 1) // num_splits)
    chunk = -(-chunk // block_n) * block_n
    splits = max(1, -(-prefix // chunk))
    return TreeAttentionLaunch(
        block_t=block_t,
        block_m=block_m,
        block_n=block_n,
        block_d=block_d,
        num_splits=splits,
        chunk_len=chunk,
        num_warps=8 if block_m >= (64 if fp32 else 128) else 4,
        num_stages=3 if block_d <= 128 and not fp32 else 2,
    )


def split_kernel_constexprs(plan: TreeAttentionLaunch, group: int, head_dim: int, dtype: torch.dtype,
                            *, upcast: bool, write_final: bool) -> dict:
    """The compile-time arguments of ``_tree_attn_split_kernel`` for one launch."""
    return dict(
        GROUP=group,
        BLOCK_T=plan.block_t,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_D=plan.block_d,
        HEAD_DIM=head_dim,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",  # ignored for 16-bit inputs
        WRITE_FINAL=write_final,
    )


def _validate(q, k, v, tree_mask, scale, impl) -> float:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {x.dtype} not supported; use float16, bfloat16 or float32")
    if not isinstance(tree_mask, torch.Tensor):
        raise TypeError(f"tree_mask must be a torch.Tensor, got {type(tree_mask).__name__}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, heads_q, nodes, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head dim")
    if nodes < 1 or nodes > MAX_TREE_NODES:
        raise ValueError(f"tree nodes T must be in [1, {MAX_TREE_NODES}], got {nodes}")
    if head_dim < 1:
        raise ValueError("head dim D must be >= 1")
    heads_kv = k.shape[1]
    if heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(f"query heads ({heads_q}) must be a positive multiple of kv heads ({heads_kv})")
    if k.shape[2] < nodes:
        raise ValueError(f"k/v hold {k.shape[2]} positions, fewer than the {nodes} tree nodes")
    if tree_mask.shape != (nodes, nodes):
        raise ValueError(f"tree_mask must be [T, T] = [{nodes}, {nodes}], got {tuple(tree_mask.shape)}")
    if tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be bool, got {tree_mask.dtype}")
    for name, x in (("k", k), ("v", v), ("tree_mask", tree_mask)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def tree_attention(
    q: torch.Tensor,  # [B, Hq, T, D]
    k: torch.Tensor,  # [B, Hkv, L + T, D]
    v: torch.Tensor,  # [B, Hkv, L + T, D]
    tree_mask: torch.Tensor,  # [T, T] bool
    scale: float | None = None,
    impl: str = "auto",
    *,
    num_splits: int | None = None,
) -> torch.Tensor:  # [B, Hq, T, D]
    """Attention of T tree nodes over an L-entry prefix plus the tree itself.

    Every node attends all L prefix entries; among the tree nodes, node i attends
    node j iff ``tree_mask[i, j]``. ``scale`` defaults to 1/sqrt(D). ``impl``:
    ``"auto"`` (Triton for CUDA tensors, the reference otherwise), ``"triton"``
    (CUDA, or any device under TRITON_INTERPRET=1) or ``"torch"`` (the reference).
    fp16/bf16/fp32 inputs, fp32 accumulation, output in q's dtype. k and v may be
    strided views (e.g. ``cache[:, :, :L+T]``) as long as D is contiguous.
    ``num_splits`` overrides the prefix split count of the Triton path.
    """
    scale = _validate(q, k, v, tree_mask, scale, impl)
    use_triton = impl == "triton" or (impl == "auto" and q.is_cuda and triton is not None)
    if not use_triton:
        return tree_attention_reference(q, k, v, tree_mask, scale)
    if triton is None:
        raise ValueError("impl='triton' needs the triton package (pip install specops[kernels])")
    if not q.is_cuda and not triton_interpreting():
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got device {q.device}")
    return _tree_attention_triton(q, k, v, tree_mask, scale, num_splits)


def _tree_attention_triton(q, k, v, tree_mask, scale, num_splits):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension, got strides {x.stride()}")
    if q.is_cuda:
        with torch.cuda.device(q.device):  # Triton launches on the current device's stream
            return _launch(q, k, v, tree_mask, scale, num_splits, _sm_count(torch.cuda.current_device()))
    return _launch(q, k, v, tree_mask, scale, num_splits, 4)  # interpreter: a nominal 4-SM device


def _launch(q, k, v, tree_mask, scale, num_splits, sm_count):
    batch, heads_q, nodes, head_dim = q.shape
    heads_kv = k.shape[1]
    group = heads_q // heads_kv
    prefix = k.shape[2] - nodes
    plan = plan_launch(batch, heads_kv, group, nodes, prefix, head_dim, sm_count=sm_count,
                       elem_bytes=q.element_size(), num_splits=num_splits)

    mask_u8 = tree_mask.contiguous().view(torch.uint8)  # [T, T], zero-copy reinterpretation of bool
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [B, Hq, T, D]
    splits = plan.num_splits
    write_final = splits == 1
    if write_final:
        m_part = l_part = acc_part = out  # unused by the kernel in this mode
    else:
        m_part = torch.empty(batch, heads_q, splits, nodes, device=q.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(batch, heads_q, splits, nodes, head_dim, device=q.device, dtype=torch.float32)
    upcast = q.dtype == torch.bfloat16 and triton_interpreting()
    grid = (-(-nodes // plan.block_t), splits, batch * heads_kv)
    _tree_attn_split_kernel[grid](
        q, k, v, mask_u8,
        m_part, l_part, acc_part, out,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        mask_u8.stride(0),
        heads_kv, prefix, nodes, plan.chunk_len, splits, scale * _LOG2E,
        **split_kernel_constexprs(plan, group, head_dim, q.dtype, upcast=upcast, write_final=write_final),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if not write_final:
        block_t = min(64, _next_pow2(nodes))
        _tree_attn_reduce_kernel[(-(-nodes // block_t), batch * heads_q)](
            m_part, l_part, acc_part, out,
            out.stride(0), out.stride(1), out.stride(2),
            heads_q, nodes, splits,
            BLOCK_T=block_t,
            BLOCK_D=plan.block_d,
            HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out
