"""Linear layers for a few rows on CPU: a small C kernel (``gemv.c``, in the CPU kernels'
library that `specops.kernels.linear_lib` loads) that streams each weight once for all rows
of x and splits the output over a persistent thread pool (``pool.c``).

Why: a decoding step of a small fp32 model is bound by reading its weights (the bundled
target's 33 matrices are 27 MB, more than a core's caches hold). Measured on this
project's 2-core CPU, thread CPU time over the 33 matrices in a row, 1 thread: MKL `mm`
on the input-major weight 2.1 ms, oneDNN prepacked 2.3 ms, this kernel 1.05 ms at one
row; 2.7 / 2.2 ms at five rows. And torch's intra-op pool leaves a one-row matmul on one
thread, so a second core did nothing for plain decoding; here it takes half the rows.

Each output element is computed in a fixed order, whatever the rows of x or the thread
count (see gemv.c), so a verification forward over several positions gives the
same logits bit for bit as one-position forwards would.

The kernel reads its weights in panels (`pack`: the same [N, K] shape and element count,
the buffer permuted so that each k holds 32 output rows' weights side by side), which
spares every output a horizontal sum. `linear` takes nn.Linear's [N, K] weight and packs it
per call; callers that call again (`PackedLinear`, the layer tables) pack once and use
`unchecked` and the layer-stack calls, which take packed weights only.

Beside the linear layer: a row argmax that leaves torch's OpenMP team asleep (`argmax`)
and an embedding gather that does too (`embedding`). The library's other wrappers are
modules of their own, and every name of theirs is also one of this module's (callers use
``cpu_linear.<name>``): `cpu_attention` (the attention of a few new positions over a dense
cache, causal or by a tree's visibility mask, split over the same pool), `cpu_layers` (the
fast runner's whole layer stack in one call, `llama_layers`, its drafting loops and the
ragged-batch paged stack), `cpu_medusa`, `cpu_steps` and `cpu_verify`.

Where the library comes from, `loaded_from`; none (no prebuilt set and no compiler, a failed
build, or ``SPECOPS_CPU_KERNELS=0``): `available()` is False and callers keep MKL / oneDNN
(see `specops.kernels.linear_lib`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specops.kernels.cpu_attention import MAX_MASK_NODES, causal_attention, mask_bits, rope_cache_attention
from specops.kernels.cpu_layers import (LayerWeights, RaggedBatch, layer_table, llama_draft, llama_layers,
                                        paged_draft, paged_layers)
from specops.kernels.cpu_medusa import MedusaWeights, medusa_candidates
from specops.kernels.cpu_steps import StepLoop, medusa_tree_words
from specops.kernels.cpu_verify import verify_sampled
from specops.kernels.linear_lib import (SOURCE, WEIGHTS_BF16, _kernel, available, bf16_weights, loaded_from,
                                        unavailable_reason)

__all__ = [  # the wrapper modules' names too: callers use them as cpu_linear.<name>
    "MAX_MASK_NODES", "MAX_ROWS", "PANEL", "SOURCE", "TORCH_GRAIN", "WEIGHTS_BF16", "LayerWeights",
    "MedusaWeights", "RaggedBatch", "StepLoop", "argmax", "available", "bf16_weights", "causal_attention",
    "embedding", "layer_table", "linear", "llama_draft", "llama_layers", "loaded_from", "mask_bits",
    "medusa_candidates", "medusa_tree_words", "pack", "paged_draft", "paged_layers", "pool_last_threads",
    "pool_workers", "rope_cache_attention", "unavailable_reason", "unchecked", "unpack", "verify_sampled",
]

MAX_ROWS = 8  # rows of x up to which the kernel is used (above, oneDNN's blocked GEMM wins)
PANEL = 32  # output rows per weight panel (gemv.h)


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
