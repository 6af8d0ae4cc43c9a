"""Linear layers for a few rows on CPU: a small C kernel (``linear.c``) that streams each
weight once for all rows of x and splits the output over a persistent thread pool.

Why: a decoding step of a small fp32 model is bound by reading its weights (the bundled
target's 33 matrices are 27 MB, more than a core's caches hold). Measured on this
project's 2-core CPU, thread CPU time over the 33 matrices in a row, 1 thread: MKL `mm`
on the input-major weight 2.1 ms, oneDNN prepacked 2.3 ms, this kernel 1.05 ms at one
row; 2.7 / 2.2 ms at five rows. And torch's intra-op pool leaves a one-row matmul on one
thread, so a second core did nothing for plain decoding; here it takes half the rows.

Each output element is computed in a fixed order, whatever the rows of x or the thread
count (see the C file), so a verification forward over several positions gives the
same logits bit for bit as one-position forwards would.

The kernel reads its weights in panels (`pack`: the same [N, K] shape and element count,
the buffer permuted so that each k holds 32 output rows' weights side by side), which
spares every output a horizontal sum. `linear` takes nn.Linear's [N, K] weight and packs it
per call; callers that call again (`PackedLinear`, the layer tables) pack once and use
`unchecked` and the layer-stack calls, which take packed weights only.

Beside the linear layer: the attention of a few new positions over a dense cache
(causal, or a tree's visibility mask, split over the same pool), the fast runner's whole
layer stack in one call (`llama_layers`), and a row argmax that leaves torch's OpenMP
team asleep (`argmax`).

Loaded like `specops.kernels.cpu_paged` (`specops.kernels.cbuild`: the prebuilt variant for
this CPU where an image ships one, else built with the system C compiler, ``-O3
-march=native``, into a cache keyed by the compiler's target features, sources and flags;
loaded with ctypes, which releases the GIL; `loaded_from` says which). Neither, a failed
build, or ``SPECOPS_CPU_KERNELS=0``: `available()` is False and callers keep MKL / oneDNN.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from specops.kernels.cbuild import LazyKernel

SOURCE = Path(__file__).with_name("linear.c")
MAX_ROWS = 8  # rows of x up to which the kernel is used (above, oneDNN's blocked GEMM wins)
PANEL = 32  # output rows per weight panel (linear.c)


def _setup(lib: ctypes.CDLL) -> None:
    fn = lib.specops_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                                    ctypes.c_float]
    att = lib.specops_attention
    att.restype = ctypes.c_int
    att.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                     ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
    lib.specops_bf16_weights.restype = ctypes.c_int
    lib.specops_bf16_weights.argtypes = []
    for name in ("specops_pool_workers", "specops_pool_last_threads"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    arg = lib.specops_argmax_rows
    arg.restype = None
    arg.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    layers = lib.specops_llama_layers
    layers.restype = ctypes.c_int
    layers.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 6 +
                       [ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 +
                       [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] +
                       [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p])
    draft = lib.specops_llama_draft
    draft.restype = ctypes.c_int
    draft.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 2 +
                       [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_float] +
                       [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int] +
                       [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_void_p] +
                       [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p])
    vs = lib.specops_verify_sampled
    vs.restype = None
    vs.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_double,
                                                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    paged = lib.specops_paged_layers
    paged.restype = ctypes.c_int
    paged.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 6 +
                      [ctypes.c_float, ctypes.c_float] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] +
                      [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] +
                      [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p,
                                                                                 ctypes.c_int64] +
                      [ctypes.c_void_p] * 2 + [ctypes.c_int])
    chain = lib.specops_paged_draft
    chain.restype = ctypes.c_int
    chain.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] +
                      [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_float] +
                      [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] +
                      [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                               ctypes.c_void_p] + [ctypes.c_void_p] * 4)
    med = lib.specops_medusa_candidates
    med.restype = ctypes.c_int
    med.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                     ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_int])
    step = lib.specops_medusa_step
    step.restype = ctypes.c_int
    step.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                     ctypes.c_void_p]
    chain = lib.specops_chain_verify
    chain.restype = ctypes.c_int
    chain.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    fused = lib.specops_rope_cache_attention
    fused.restype = ctypes.c_int
    fused.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [
        ctypes.c_float, ctypes.c_void_p, ctypes.c_int]


_kernel = LazyKernel(SOURCE, "linear", _setup, "CPU linear kernel", "MKL / oneDNN")


available = _kernel.available  # whether the kernel is built and loaded (builds it on the first call)
unavailable_reason = _kernel.unavailable_reason  # why not (None when it is)
loaded_from = _kernel.loaded_from  # "prebuilt <variant>: <path>" or "built: <path>" (None: not loaded)


WEIGHTS_BF16 = 8  # mode flag of the C kernel: the weight is bfloat16 (`bf16_weights`)


def bf16_weights() -> bool:
    """Whether the kernel reads bfloat16 weights (widened to fp32 in registers: an AVX-512
    BW/VL build). Drafting models use them: half the bytes per token, and a drafter's
    logits only propose tokens, so the output stays exact."""
    return available() and bool(_kernel.lib.specops_bf16_weights())


def pool_workers() -> int:
    """Worker threads the kernel's pool has started (a job with ``threads`` uses the caller
    and at most ``threads - 1`` of them; the others stay asleep)."""
    return int(_kernel.require().specops_pool_workers())


def pool_last_threads() -> int:
    """Threads, the caller included, that ran chunks of the last job split over the pool (0
    before the first; a job the caller runs alone, below ``MIN_ROWS_PER_THREAD`` rows per
    thread or with ``threads=1``, is not split and does not change it)."""
    return int(_kernel.require().specops_pool_last_threads())


def pack(weight: Tensor) -> Tensor:
    """``weight`` [N, K] (nn.Linear's layout) in the kernel's panel layout: a contiguous
    tensor of the same shape and dtype whose buffer holds, for each whole panel of PANEL
    output rows, [K][PANEL] (row k: the panel's weights at input k), then the last
    N % PANEL rows as [K][N % PANEL]. Only the C kernel reads it; see `unpack`."""
    n, k = weight.shape
    full = n - n % PANEL
    out = torch.empty((n, k), dtype=weight.dtype, device=weight.device)
    flat = out.view(-1)
    with torch.no_grad():
        flat[: full * k] = weight[:full].reshape(full // PANEL, PANEL, k).transpose(1, 2).reshape(-1)
        if n > full:
            flat[full * k:] = weight[full:].t().reshape(-1)
    return out


def unpack(packed: Tensor) -> Tensor:
    """The [N, K] weight a `pack`ed tensor holds (a new tensor)."""
    n, k = packed.shape
    full = n - n % PANEL
    flat = packed.reshape(-1)
    out = torch.empty((n, k), dtype=packed.dtype, device=packed.device)
    out[:full] = flat[: full * k].view(full // PANEL, k, PANEL).transpose(1, 2).reshape(full, k)
    if n > full:
        out[full:] = flat[full * k:].view(k, n - full).t()
    return out


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, add: Tensor | None = None,
           out: Tensor | None = None, threads: int | None = None, *, norm: Tensor | None = None,
           eps: float = 1e-6, swiglu: bool = False) -> Tensor:
    """``f(x) @ weight.T (+ bias) (+ add)``: x [T, K], weight [N, K] (nn.Linear's layout, packed
    here on every call: see `pack`), bias [N], add [T, N], all contiguous fp32 on CPU. ``out``
    [T, N] (may be ``add``) is written and returned.

    f: identity; with ``norm`` [K], RMSNorm (``norm * x / sqrt(mean(x^2) + eps)``); with
    ``swiglu``, x is [T, 2K] (gate | up) and f(x) = silu(gate) * up."""
    _kernel.require()
    if norm is not None and swiglu:
        raise ValueError("norm and swiglu are exclusive")
    t, k = x.shape
    if swiglu:
        if k % 2:
            raise ValueError(f"swiglu input must be [T, 2K], got {k} features")
        k //= 2
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features, the weight {weight.shape[1]}")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"norm must be [{k}], got {tuple(norm.shape)}")
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias), ("add", add), ("out", out), ("norm", norm)):
        if tensor is None:
            continue
        half = name == "weight" and tensor.dtype == torch.bfloat16 and bf16_weights()
        if (tensor.dtype != torch.float32 and not half) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 CPU tensor" +
                             (" (or bfloat16, where bf16_weights())" if name == "weight" else ""))
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if add is not None and add.shape != (t, n):
        raise ValueError(f"add must be [{t}, {n}], got {tuple(add.shape)}")
    if out is None:
        out = torch.empty(t, n, dtype=torch.float32)
    elif out.shape != (t, n):
        raise ValueError(f"out must be [{t}, {n}], got {tuple(out.shape)}")
    return unchecked(x, pack(weight), bias, add, out, norm, eps, swiglu, threads)


def unchecked(x: Tensor, weight: Tensor, bias: Tensor | None, add: Tensor | None, out: Tensor | None,
              norm: Tensor | None, eps: float, swiglu: bool, threads: int | None = None) -> Tensor:
    """`linear` without its argument checks, for callers that guarantee them (`PackedLinear`
    validates its weights once and loads the kernel; x, add and out must be contiguous fp32
    of the right shapes). ``weight`` is `pack`ed; it may be bfloat16 where `bf16_weights`
    says so."""
    t, n = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(t, n, dtype=torch.float32)
    mode = (1 if norm is not None else 2 if swiglu else 0) | (WEIGHTS_BF16 if weight.dtype == torch.bfloat16 else 0)
    rc = _kernel.lib.specops_linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                             None if add is None else add.data_ptr(), out.data_ptr(), t, weight.shape[1], n,
                             int(threads or torch.get_num_threads()), mode, None if norm is None else norm.data_ptr(), float(eps))
    if rc != 0:
        raise MemoryError("CPU linear kernel: no memory for its input buffer" if rc == 2 else
                          f"CPU linear kernel failed (code {rc}: bfloat16 weights this build cannot read)")
    return out


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


class LayerWeights(ctypes.Structure):
    """One layer's pointers for `llama_layers` (fields as the C struct ``LayerWeights``)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("ln1", "qkv_w", "qkv_b", "o_w", "o_b", "ln2", "gu_w", "gu_b",
                                                       "down_w", "down_b", "k_cache", "v_cache")] + [
        ("flags", ctypes.c_int64)]


def layer_table(layers: list[dict[str, Tensor | None]]) -> ctypes.Array:
    """The C array of `LayerWeights` for `llama_layers`: one dict per layer with the fields'
    tensors (contiguous fp32 CPU, or the four ``*_w`` matrices all bfloat16; the ``*_w``
    matrices `pack`ed; biases may be None). The tensors must outlive the table."""
    table = (LayerWeights * len(layers))()
    for row, layer in zip(table, layers):
        bf16 = layer["qkv_w"].dtype == torch.bfloat16
        for name, kind in LayerWeights._fields_:
            if kind is not ctypes.c_void_p:
                continue
            tensor = layer.get(name)
            want = torch.bfloat16 if bf16 and name.endswith("_w") else torch.float32
            if tensor is not None and (tensor.dtype != want or tensor.device.type != "cpu"):
                raise ValueError(f"{name} must be a {want} CPU tensor")
            setattr(row, name, None if tensor is None else tensor.data_ptr())
        row.flags = WEIGHTS_BF16 if bf16 else 0
    return table


def llama_layers(table: ctypes.Array, x: Tensor, *, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, scale: float, cos: Tensor, sin: Tensor, kv_strides: tuple[int, int], start: int,
                 norm: Tensor, head: Tensor, head_bias: Tensor | None = None, mask: Tensor | None = None,
                 threads: int | None = None, logit_rows: int | None = None,
                 argmax: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Every layer of a Llama-family stack over T new tokens of one sequence, the final norm
    and the LM head in one call (see ``specops_llama_layers`` in linear.c): x [T, E]
    (contiguous) is the residual stream (updated in place). Returns the normed hidden states
    [T, E], the logits [R, V] of the last R = ``logit_rows`` positions (None: all T; a
    prompt pass asks for 1 or 0) and, with ``argmax``, each logit row's `argmax` [R] long
    (computed in the same call), else None. Arguments as `rope_cache_attention`; ``kv_strides`` the
    caches' (sequence, head) strides; ``head`` [V, E], `pack`ed. Unchecked beyond the mask and
    ``logit_rows``: the fast runner calls it with the shapes it built the table for."""
    _check_mask(mask, x.shape[0])
    t, e = x.shape
    rows = t if logit_rows is None else int(logit_rows)
    if not 0 <= rows <= t:
        raise ValueError(f"logit_rows must be in 0..{t}, got {logit_rows}")
    vocab = head.shape[0]
    hidden = torch.empty(t, e, dtype=torch.float32)
    logits = torch.empty(rows, vocab, dtype=torch.float32)
    choice = torch.empty(rows, dtype=torch.int64) if argmax and rows else None
    scratch = torch.empty(t * ((heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * intermediate),
                          dtype=torch.float32)
    rc = _kernel.lib.specops_llama_layers(table, len(table), x.data_ptr(), t, e, heads, kv_heads, head_dim,
                                          intermediate, float(eps), float(scale), cos.data_ptr(), sin.data_ptr(),
                                          kv_strides[0], kv_strides[1], start,
                                          None if mask is None else mask.data_ptr(), scratch.data_ptr(),
                                          int(threads or torch.get_num_threads()), norm.data_ptr(), head.data_ptr(),
                                          None if head_bias is None else head_bias.data_ptr(), vocab,
                                          hidden.data_ptr(), logits.data_ptr(),
                                          WEIGHTS_BF16 if head.dtype == torch.bfloat16 else 0, rows,
                                          None if choice is None else choice.data_ptr())
    if rc != 0:
        raise MemoryError(f"CPU layer-stack kernel failed (code {rc})")
    return hidden, logits, choice


def llama_draft(table: ctypes.Array, embed: Tensor, tokens: list[int], count: int, *, heads: int, kv_heads: int,
                 head_dim: int, intermediate: int, eps: float, scale: float, cos: Tensor, sin: Tensor,
                 kv_strides: tuple[int, int], start: int, norm: Tensor, head: Tensor, head_bias: Tensor | None = None,
                 threads: int | None = None, uniforms: Tensor | None = None,
                 temperature: float = 1.0, head_ids: Tensor | None = None) -> tuple[list[int], Tensor | None]:
    """Drafting in one C call (``specops_llama_draft`` in linear.c): `llama_layers` over
    ``tokens`` after ``start`` cached positions, then ``count - 1`` single-token steps, each
    feeding back the token chosen from the last logits: their argmax, or with ``uniforms``
    ([count] float64 in [0, 1)) a draw from q = softmax(logits / temperature). Returns the
    ``count`` tokens and, when sampling, q [count, V] (else None); the cache gains
    ``len(tokens) + count - 1`` positions (the caller advances its length). ``embed``
    [vocab, E] fp32 contiguous, ``cos`` / ``sin`` the runner's whole [positions, D] tables.
    With ``head_ids`` [F] long (greedy only), ``head`` holds those tokens' rows of the LM head
    (a draft vocabulary, `FastLlamaRunner.set_draft_vocab`) and the argmax row r drafts token
    head_ids[r]. Unchecked beyond the token ids and uniforms: the fast runner calls it with the
    shapes it built the table for and room in its cache."""
    t = len(tokens)
    vocab, e = head.shape[0], embed.shape[1]
    if t < 1 or count < 1:
        raise ValueError(f"llama_draft needs >= 1 token and count >= 1, got {t} tokens, count {count}")
    if head_ids is not None and (uniforms is not None or head_ids.shape != (vocab,) or head_ids.dtype != torch.int64
                                 or not head_ids.is_contiguous()):
        raise ValueError("head_ids must be a contiguous int64 [F] tensor naming the head's rows, for greedy drafting")
    # ids in and tokens out as ctypes arrays, the float buffers as one tensor: this runs between
    # two target forwards, where each small tensor op costs several times its warm time
    limit = embed.shape[0] if head_ids is not None else min(vocab, embed.shape[0])
    if min(tokens) < 0 or max(tokens) >= limit:
        raise ValueError(f"token ids must be in [0, {limit})")
    ids = (ctypes.c_int64 * t)(*tokens)
    q = None
    if uniforms is not None:
        if uniforms.dtype != torch.float64 or uniforms.shape != (count,) or not uniforms.is_contiguous():
            raise ValueError(f"uniforms must be a contiguous float64 tensor of shape ({count},)")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        q = torch.empty(count, vocab, dtype=torch.float32)
    out = (ctypes.c_int64 * count)()

    def part(n: int) -> int:  # floats, rounded up to whole 64-byte lines
        return -(-n // 16) * 16

    sizes = (part(t * e), part(t * e), part(vocab),  # x, hidden, logits, then scratch
             t * ((heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * intermediate))
    buf = torch.empty(sum(sizes), dtype=torch.float32)
    x = buf.data_ptr()
    hidden, logits = x + 4 * sizes[0], x + 4 * (sizes[0] + sizes[1])
    scratch = logits + 4 * sizes[2]
    rc = _kernel.lib.specops_llama_draft(table, len(table), embed.data_ptr(), ids, t, count, x,
                                          e, heads, kv_heads, head_dim, intermediate, float(eps), float(scale),
                                          cos.data_ptr(), sin.data_ptr(), kv_strides[0], kv_strides[1], start,
                                          scratch, int(threads or torch.get_num_threads()), norm.data_ptr(),
                                          head.data_ptr(), None if head_bias is None else head_bias.data_ptr(), vocab,
                                          hidden, logits, WEIGHTS_BF16 if head.dtype == torch.bfloat16 else 0, out,
                                          None if uniforms is None else uniforms.data_ptr(), 1.0 / float(temperature),
                                          None if q is None else q.data_ptr(),
                                          None if head_ids is None else head_ids.data_ptr())
    if rc != 0:
        raise MemoryError(f"CPU drafting kernel failed (code {rc})")
    return list(out), q


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


@dataclass
class RaggedBatch:
    """Where the flat tokens of a ragged batch belong, for `paged_layers` (numpy, C layouts).

    Sequence s owns flat tokens ``first[s] .. first[s+1]-1``; they follow ``start[s]`` cached
    entries; cache position p of s is slot ``tables[s, p // block_size] * block_size +
    p % block_size``; its new tokens see each other causally, or, where ``masked[s]``, by
    ``words[n]`` (`mask_bits` of its [T, T] tree mask, T <= 64). ``positions[n]`` is token
    n's rotary position (cache position for chains, prefix + depth for tree nodes)."""

    positions: np.ndarray  # [N] int32
    first: np.ndarray  # [S + 1] int64
    start: np.ndarray  # [S] int64
    tables: np.ndarray  # [S, blocks] int32
    block_size: int
    words: np.ndarray  # [N] int64 (uint64 bits)
    masked: np.ndarray  # [S] int8

    def keys(self) -> int:
        """The most keys any token attends to."""
        return int((self.start + np.diff(self.first)).max())


def paged_layers(table: ctypes.Array, x: Tensor, batch: RaggedBatch, rows: Tensor, *, heads: int, kv_heads: int,
                 head_dim: int, intermediate: int, eps: float, scale: float, cos: Tensor, sin: Tensor, norm: Tensor,
                 head: Tensor, head_bias: Tensor | None = None, threads: int | None = None) -> tuple[Tensor, Tensor]:
    """`llama_layers` over a ragged batch of sequences on a block-paged store (see
    ``specops_paged_layers`` in linear.c): x [N, E] (contiguous fp32, updated in place) holds
    the embeddings of every sequence's new tokens, flat; ``table`` is `layer_table` with each
    layer's k_cache / v_cache its [slots, Hkv, D] half of the store; ``cos`` / ``sin`` the
    runner's [positions, D] rotary tables. Each token's key and value go to its cache slot,
    and its outputs equal the single-sequence stack's bit for bit. Returns the normed hidden
    states [R, E] and logits [R, V] of the flat rows ``rows`` [R]."""
    n, e = x.shape
    s = batch.start.shape[0]
    if batch.positions.shape != (n,) or batch.first.shape != (s + 1,) or batch.words.shape != (n,):
        raise ValueError("a ragged batch's positions, first and words disagree with x")
    if int(batch.positions.max(initial=0)) >= cos.shape[0]:
        raise ValueError(f"a rotary position is past the table's {cos.shape[0]}")
    rows = rows.contiguous()
    r = rows.shape[0]
    vocab = head.shape[0]
    hidden = torch.empty(r, e, dtype=torch.float32)
    logits = torch.empty(r, vocab, dtype=torch.float32)
    scratch = torch.empty(n * ((heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * intermediate),
                          dtype=torch.float32)
    tables = np.ascontiguousarray(batch.tables, dtype=np.int32)
    arrays = [np.ascontiguousarray(a, dtype=t) for a, t in ((batch.positions, np.int32), (batch.first, np.int64),
                                                            (batch.start, np.int64), (batch.words, np.int64),
                                                            (batch.masked, np.int8))]
    pos, first, start, words, masked = arrays
    rc = _kernel.lib.specops_paged_layers(
        table, len(table), x.data_ptr(), n, e, heads, kv_heads, head_dim, intermediate, float(eps), float(scale),
        cos.data_ptr(), sin.data_ptr(), pos.ctypes.data, s, first.ctypes.data, start.ctypes.data,
        tables.ctypes.data, tables.shape[1], batch.block_size, words.ctypes.data, masked.ctypes.data, batch.keys(),
        scratch.data_ptr(), int(threads or torch.get_num_threads()), norm.data_ptr(),
        head.data_ptr(), None if head_bias is None else head_bias.data_ptr(), vocab,
        rows.data_ptr(), r, hidden.data_ptr(), logits.data_ptr(), WEIGHTS_BF16 if head.dtype == torch.bfloat16 else 0)
    if rc == 3:
        raise ValueError("CPU paged layer-stack kernel refused the batch's shapes")
    if rc != 0:
        raise MemoryError(f"CPU paged layer-stack kernel failed (code {rc})")
    return hidden, logits


def paged_draft(table: ctypes.Array, embed: Tensor, tokens: list[int], first: np.ndarray, start: np.ndarray,
                gammas: list[int], tables: np.ndarray, block_size: int, *, heads: int, kv_heads: int, head_dim: int,
                intermediate: int, eps: float, scale: float, cos: Tensor, sin: Tensor, norm: Tensor, head: Tensor,
                head_bias: Tensor | None = None, threads: int | None = None,
                clock_id: int | None = None, uniforms: np.ndarray | None = None,
                inv_temps: np.ndarray | None = None, q_out: Tensor | None = None,
                head_ids: Tensor | None = None) -> tuple[list[list[int]], list[float] | None]:
    """Drafting of a ragged batch in one call (``specops_paged_draft`` in linear.c):
    round 0 feeds sequence s its ``tokens[first[s]:first[s+1]]`` after ``start[s]`` cached
    ones, each later round one token, the last one chosen, to the sequences still short of
    their ``gammas[s]`` (>= 1) tokens. A token is the argmax, or, for a sequence s with
    ``inv_temps[s] > 0`` ([S] float32: 1 / temperature, 0 = greedy), a draw from q =
    softmax(logits * inv_temps[s]) with the uniform ``uniforms[s, r]`` ([S, G] float64 in
    [0, 1), G = max(gammas)), q written to ``q_out[s, r]`` ([S, G, V] fp32, contiguous; the
    rows of greedy sequences and past each ``gammas[s]`` are left as they were). ``table``,
    ``embed`` [vocab, E], ``tables`` [S, blocks] and the shapes are `paged_layers`' (the draft
    model's). With ``head_ids`` [F] long (greedy only: no ``inv_temps``), ``head`` holds
    those tokens' rows of the LM head (a draft vocabulary, `FastLlamaRunner.set_draft_vocab`)
    and the argmax row r drafts token head_ids[r]. Returns each sequence's tokens and, with
    ``clock_id`` (a ``time.CLOCK_*`` id), each round's seconds on that clock; the same tokens
    and cache as a loop of `paged_layers` rounds and argmaxes, bit for bit."""
    s = len(gammas)
    n0 = len(tokens)
    first = np.ascontiguousarray(first, dtype=np.int64)
    start = np.ascontiguousarray(start, dtype=np.int64)
    tables = np.ascontiguousarray(tables, dtype=np.int32)
    if first.shape != (s + 1,) or start.shape != (s,) or tables.ndim != 2 or tables.shape[0] != s:
        raise ValueError("paged_draft: first, start and tables disagree with gammas")
    if s < 1 or min(gammas) < 1 or np.any(np.diff(first) < 1) or first[0] != 0 or first[-1] != n0:
        raise ValueError("paged_draft: every sequence feeds at least one token and drafts at least one")
    last = start + np.diff(first) + np.asarray(gammas, dtype=np.int64) - 2  # the last position each one feeds
    if int(last.max()) >= cos.shape[0]:
        raise ValueError(f"a rotary position is past the table's {cos.shape[0]}")
    if not embed.is_contiguous() or embed.dtype != torch.float32:
        raise ValueError("embed must be contiguous fp32")
    g = max(gammas)
    m = max(n0, s)
    e = embed.shape[1]
    vocab = head.shape[0]
    if (uniforms is None) != (inv_temps is None) or (inv_temps is None) != (q_out is None):
        raise ValueError("paged_draft: sampling needs uniforms, inv_temps and q_out together")
    if head_ids is not None and (inv_temps is not None or head_ids.shape != (vocab,) or head_ids.dtype != torch.int64
                                 or not head_ids.is_contiguous()):
        raise ValueError("paged_draft: head_ids must be a contiguous int64 [F] tensor naming the head's rows, "
                         "for greedy drafting only")
    if inv_temps is not None:
        uniforms = np.ascontiguousarray(uniforms, dtype=np.float64)
        inv_temps = np.ascontiguousarray(inv_temps, dtype=np.float32)
        if uniforms.shape != (s, g) or inv_temps.shape != (s,):
            raise ValueError(f"paged_draft: uniforms must be [{s}, {g}] and inv_temps [{s}]")
        if not (np.all(np.isfinite(inv_temps)) and np.all(inv_temps >= 0)):
            raise ValueError("paged_draft: inv_temps must be finite and >= 0 (0: greedy)")
        if uniforms.size and not (float(uniforms.min()) >= 0.0 and float(uniforms.max()) < 1.0):
            raise ValueError("paged_draft: uniforms must be in [0, 1)")
        if q_out.dtype != torch.float32 or tuple(q_out.shape) != (s, g, vocab) or not q_out.is_contiguous():
            raise ValueError(f"paged_draft: q_out must be a contiguous fp32 tensor of shape ({s}, {g}, {vocab})")
    toks = np.ascontiguousarray(tokens, dtype=np.int64)
    gam = np.ascontiguousarray(gammas, dtype=np.int64)
    out = np.zeros((s, g), dtype=np.int64)
    rounds = np.zeros(g, dtype=np.float64) if clock_id is not None else None
    x = torch.empty(m, e, dtype=torch.float32)
    hidden = torch.empty(s, e, dtype=torch.float32)
    logits = torch.empty(s, vocab, dtype=torch.float32)
    scratch = torch.empty(m * ((heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * intermediate),
                          dtype=torch.float32)
    rc = _kernel.lib.specops_paged_draft(
        table, len(table), embed.data_ptr(), toks.ctypes.data, s, first.ctypes.data, start.ctypes.data,
        gam.ctypes.data, tables.ctypes.data, tables.shape[1], block_size, e, heads, kv_heads, head_dim, intermediate,
        float(eps), float(scale), cos.data_ptr(), sin.data_ptr(), x.data_ptr(), scratch.data_ptr(),
        int(threads or torch.get_num_threads()), norm.data_ptr(), head.data_ptr(),
        None if head_bias is None else head_bias.data_ptr(), vocab, hidden.data_ptr(), logits.data_ptr(),
        WEIGHTS_BF16 if head.dtype == torch.bfloat16 else 0, out.ctypes.data, g,
        -1 if clock_id is None else int(clock_id), None if rounds is None else rounds.ctypes.data,
        None if uniforms is None else uniforms.ctypes.data, None if inv_temps is None else inv_temps.ctypes.data,
        None if q_out is None else q_out.data_ptr(), None if head_ids is None else head_ids.data_ptr())
    if rc == 3:
        raise ValueError("CPU paged drafting kernel refused the batch's shapes")
    if rc != 0:
        raise MemoryError(f"CPU paged drafting kernel failed (code {rc})")
    return [out[i, : gammas[i]].tolist() for i in range(s)], None if rounds is None else rounds.tolist()


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


def _flags(weight: Tensor) -> int:
    return WEIGHTS_BF16 if weight.dtype == torch.bfloat16 else 0


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
        None if weights.root is None else weights.root.data_ptr(), 0 if weights.root is None else _flags(weights.root),
        weights._w, weights._b, _flags(weights.blocks[0][0][0]), k, layers, weights.lm.data_ptr(),
        None if weights.lm_bias is None else weights.lm_bias.data_ptr(), _flags(weights.lm), f,
        None if weights.ids is None else weights.ids.data_ptr(), top_k, out.data_ptr(),
        int(threads or torch.get_num_threads()))
    if rc == 3:
        raise ValueError(f"top_k must be in 1..{f} and every root id in the embedding's range")
    if rc != 0:
        raise MemoryError(f"CPU Medusa kernel failed (code {rc})")
    return out


TORCH_GRAIN = 16384
"""Elements per torch call below which torch runs an op on the calling thread (its OpenMP
grain is 32,768 elements; half of it leaves room)."""


def embedding(ids: Tensor, table: Tensor) -> Tensor:
    """``F.embedding(ids, table)`` for 1-D CPU ids, gathered in pieces of at most
    `TORCH_GRAIN` elements so that torch never wakes its OpenMP team for it. A prompt pass of
    192 tokens x 256 gathered in one call did, and the team's workers then spun on the cores
    the C layer stack's pool was using: the bundled target's prompt pass took 21.0 ms
    against 15.4 ms gathered in pieces (medians of six alternations, in-process)."""
    rows = max(1, TORCH_GRAIN // max(table.shape[1], 1))
    if ids.dim() != 1 or ids.shape[0] <= rows or table.device.type != "cpu":
        return torch.nn.functional.embedding(ids, table)
    n = ids.shape[0]
    out = torch.empty(n, table.shape[1], dtype=table.dtype)
    for i in range(0, n, rows):
        torch.index_select(table, 0, ids[i : i + rows], out=out[i : i + rows])
    return out


def argmax(x: Tensor) -> Tensor:
    """``torch.argmax(x, dim=-1)`` for fp32 CPU logits, on the calling thread alone (torch
    parallelizes a reduction of 32k+ elements over its OpenMP team, whose workers then spin
    on the core the next forward's pool needs). Other tensors, or without the kernel: torch."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] == 0 or not available():
        return torch.argmax(x, dim=-1)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(flat.shape[0], dtype=torch.int64)
    _kernel.lib.specops_argmax_rows(flat.data_ptr(), flat.shape[0], flat.shape[1], out.data_ptr())
    return out.view(x.shape[:-1])


class _StepLoopArgs(ctypes.Structure):
    """The C struct ``StepLoop`` (linear.c), field for field."""

    _fields_ = [("layers", ctypes.c_void_p), ("n_layers", ctypes.c_int64), ("embed", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("n_embed", "E", "Hq", "Hkv", "D", "I")] + [
        ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("cos_tab", ctypes.c_void_p),
        ("sin_tab", ctypes.c_void_p), ("kv_b", ctypes.c_int64), ("kv_h", ctypes.c_int64), ("norm", ctypes.c_void_p),
        ("head_w", ctypes.c_void_p), ("head_b", ctypes.c_void_p), ("V", ctypes.c_int64), ("head_flags", ctypes.c_int64),
        ("root_w", ctypes.c_void_p), ("root_flags", ctypes.c_int64), ("block_w", ctypes.c_void_p),
        ("block_b", ctypes.c_void_p), ("block_flags", ctypes.c_int64), ("K", ctypes.c_int64), ("L", ctypes.c_int64),
        ("lm_w", ctypes.c_void_p), ("lm_b", ctypes.c_void_p), ("lm_flags", ctypes.c_int64), ("F", ctypes.c_int64),
        ("ids", ctypes.c_void_p), ("TK", ctypes.c_int64), ("threads", ctypes.c_int64), ("max_nodes", ctypes.c_int64),
        ("buf", ctypes.c_void_p), ("work", ctypes.c_void_p)]


class StepLoop:
    """Decoding steps of one sequence on the batch-1 fast runner's C layer stack, each in one C
    call, with no Python between their parts (which runs with cold caches after each target
    forward: ~0.5 ms of a ~1.5 ms greedy Medusa step on the bundled models, measured):

    * `medusa_step` (``specops_medusa_step``, with Medusa ``weights``): the tree from the previous
      step's candidates, the layer stack over it, the greedy walk, the accepted path's cache
      entries compacted and the heads' next candidates;
    * `chain_verify` (``specops_chain_verify``): the forward over a pending token and a drafted
      block, and greedy acceptance.

    Every part is the kernel call the step-by-step code makes (`llama_layers`, the walk of
    `verify_tree_greedy`, `KVCache.compact_ascending`, `medusa_candidates`, `accept_greedy`),
    so outputs and cache are the same bit for bit. The target's arguments are those
    `llama_layers` takes; ``weights`` / ``num_heads`` the heads' as `medusa_candidates` (None /
    0: no Medusa steps); ``top_k`` the candidates kept per head (TK); ``max_nodes`` the most
    positions one step feeds. The tensors passed must outlive the loop."""

    def __init__(self, table: ctypes.Array, embed: Tensor, *, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float, cos: Tensor, sin: Tensor, kv_strides: tuple[int, int],
                 norm: Tensor, head: Tensor, head_bias: Tensor | None, max_nodes: int,
                 weights: MedusaWeights | None = None, num_heads: int = 0, top_k: int = 1,
                 threads: int | None = None) -> None:
        e = embed.shape[1]
        vocab = head.shape[0]
        if not 1 <= max_nodes <= MAX_MASK_NODES:
            raise ValueError(f"StepLoop: max_nodes {max_nodes} not in 1..{MAX_MASK_NODES}")
        if weights is not None:
            f = weights.lm.shape[0]
            if not 1 <= top_k <= f or not 1 <= num_heads <= len(weights.blocks):
                raise ValueError(f"StepLoop: top_k {top_k} (1..{f}), num_heads {num_heads} (1..{len(weights.blocks)})")
        if embed.dtype != torch.float32 or not embed.is_contiguous():
            raise ValueError("StepLoop: the embedding must be contiguous fp32")
        per_node = 2 * e + vocab + 2 * head_dim + (heads + 2 * kv_heads) * head_dim + heads * head_dim + 2 * intermediate
        self._buf = torch.empty(max_nodes * per_node, dtype=torch.float32)
        self._work = torch.empty(6 * max_nodes, dtype=torch.int64)
        k = num_heads if weights is not None else 0
        self.cands = torch.zeros(max(k, 1) * top_k, dtype=torch.int64)  # [K * TK] the next tree's candidates
        self.result = torch.zeros(max_nodes + 2, dtype=torch.int64)  # [P, next, accepted tokens...]
        self._heads_s = ctypes.c_double(0.0)
        self._tokens = (ctypes.c_int64 * max_nodes)()
        self._pair = (ctypes.c_int64 * 2)()
        self._nodes = ctypes.c_int64(0)
        self._keep = (table, embed, cos, sin, norm, head, head_bias, weights)
        self.top_k, self.max_nodes, self.num_heads, self.hidden_size = top_k, max_nodes, k, e
        m = _StepLoopArgs()
        m.layers, m.n_layers, m.embed = ctypes.addressof(table), len(table), embed.data_ptr()
        m.n_embed, m.E, m.Hq, m.Hkv, m.D, m.I = embed.shape[0], e, heads, kv_heads, head_dim, intermediate
        m.eps, m.scale = float(eps), float(scale)
        m.cos_tab, m.sin_tab = cos.data_ptr(), sin.data_ptr()
        m.kv_b, m.kv_h = kv_strides
        m.norm, m.head_w = norm.data_ptr(), head.data_ptr()
        m.head_b = None if head_bias is None else head_bias.data_ptr()
        m.V, m.head_flags = vocab, _flags(head)
        if weights is not None:
            m.root_w = None if weights.root is None else weights.root.data_ptr()
            m.root_flags = 0 if weights.root is None else _flags(weights.root)
            m.block_w, m.block_b = ctypes.addressof(weights._w), ctypes.addressof(weights._b)
            m.block_flags, m.K, m.L = _flags(weights.blocks[0][0][0]), k, len(weights.blocks[0])
            m.lm_w = weights.lm.data_ptr()
            m.lm_b = None if weights.lm_bias is None else weights.lm_bias.data_ptr()
            m.lm_flags, m.F = _flags(weights.lm), weights.lm.shape[0]
            m.ids = None if weights.ids is None else weights.ids.data_ptr()
        m.TK, m.threads, m.max_nodes = top_k, int(threads or torch.get_num_threads()), max_nodes
        m.buf, m.work = self._buf.data_ptr(), self._work.data_ptr()
        self._args = m
        self._medusa = _kernel.lib.specops_medusa_step
        self._chain = _kernel.lib.specops_chain_verify
        self._ptrs = (ctypes.addressof(m), self.cands.data_ptr(), self.result.data_ptr(), ctypes.addressof(self._heads_s),
                      ctypes.addressof(self._tokens), ctypes.addressof(self._pair), ctypes.addressof(self._nodes))

    def medusa_step(self, start: int, tree: Tensor, root: int, branch: list[int] | None = None) -> tuple[float, int]:
        """One Medusa step after ``start`` cached positions over the tree ``tree`` ([4, N]
        int64: see `medusa_tree_words`) rooted at ``root``, with ``branch`` (drafted tokens after
        the root, e.g. a prompt-lookup match) merged into it as into a trie, as far as
        ``max_nodes`` allows; `result` then holds [P, next, the P - 1 accepted tokens] and
        `cands` the next candidates. Returns the seconds the heads took and the nodes the step
        fed (N plus the branch's new ones). The cache gains the P path entries at
        start..start+P-1 (the caller sets its length)."""
        if self.num_heads == 0:
            raise ValueError("StepLoop: built without Medusa heads")
        args, cands, result, heads_s = self._ptrs[:4]
        m = 0
        if branch:
            m = min(len(branch), self.max_nodes)
            self._tokens[:m] = branch[:m]
        rc = self._medusa(args, start, tree.shape[1], tree.data_ptr(), root, cands, result, heads_s,
                          self._ptrs[4] if m else None, m, self._ptrs[6])
        if rc == 3:
            raise ValueError("StepLoop: a token id or the tree size out of range")
        if rc != 0:
            raise MemoryError(f"CPU Medusa step failed (code {rc})")
        return self._heads_s.value, self._nodes.value

    def chain_verify(self, start: int, tokens: list[int]) -> tuple[int, int]:
        """The forward over ``tokens`` (the pending token, then the drafted ones) after ``start``
        cached positions and greedy acceptance: (drafted tokens accepted, next token). The
        cache gains the len(tokens) entries (the caller sets its length and cuts it back)."""
        t = len(tokens)
        if not 1 <= t <= self.max_nodes:
            raise ValueError(f"StepLoop: {t} tokens to verify, at most {self.max_nodes}")
        args, ids, pair = self._ptrs[0], self._ptrs[4], self._ptrs[5]
        self._tokens[:t] = tokens
        rc = self._chain(args, start, t, ids, pair)
        if rc == 3:
            raise ValueError("StepLoop: a token id out of range")
        if rc != 0:
            raise MemoryError(f"CPU verification step failed (code {rc})")
        return self._pair[0], self._pair[1]

    def hidden(self, tokens: int, row: int) -> Tensor:
        """A copy of the normed hidden state [E] of row ``row`` of the last step, which fed
        ``tokens`` positions (`chain_verify`'s tokens, `medusa_step`'s tree nodes)."""
        e = self.hidden_size
        return self._buf[(tokens + row) * e : (tokens + row + 1) * e].clone()

    def path_node(self, i: int) -> int:
        """The tree node at place ``i`` of the last `medusa_step`'s accepted path (0: the root)."""
        return int(self._work[2 * self.max_nodes + i])


def medusa_tree_words(src: list[int], depth: list[int], parent: list[int], mask: Tensor) -> Tensor:
    """A tree as `StepLoop.medusa_step` reads it: [4, N] int64 rows src (index of each node's
    token in the K x TK candidates; the root's unused), depth, parent (-1 for the root) and the
    ancestor mask's words (`mask_bits`)."""
    words = mask_bits(mask)
    return torch.stack([torch.tensor(src, dtype=torch.int64), torch.tensor(depth, dtype=torch.int64),
                        torch.tensor(parent, dtype=torch.int64), words]).contiguous()
