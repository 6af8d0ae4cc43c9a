"""Linear layers with their weights pre-arranged for the CPU kernels that run them fastest.

Measured on this project's CPU (fp32, one thread, hidden 256): for one or two rows (a
decoding step, a one-token verification) MKL's `mm` against an input-major [in, out]
contiguous weight is the fastest option, about 2x `F.linear`'s [out, in] layout and 2x
oneDNN; from three rows on (a verification forward of γ+1 positions, a tree, a prefill)
oneDNN with a prepacked weight wins, up to 2.7x for the [E, V] LM head at 5 rows.
`PackedLinear` keeps both layouts and picks per call by the number of rows. In bfloat16
(AVX512-BF16) oneDNN wins from one row on: a decode
step of a 6.8M Llama took 2.4 ms against 3.1 ms through `mm`.

fp32 with a C compiler at hand: up to `cpu_linear.MAX_ROWS` rows go to
`specops.kernels.cpu_linear` instead (weights streamed once for all rows, split over
threads, the same arithmetic for every row count: about half MKL's time at one row), and
the input-major copy is not kept.

oneDNN's prepacked linear (`torch.ops.mkldnn._linear_pointwise`) is a private PyTorch op
(the one TorchInductor's CPU freezing uses). `onednn_usable` probes it once against `mm`
and the runner falls back to MKL alone when it is missing or disagrees, so a PyTorch
upgrade can only cost speed, never correctness.

oneDNN builds (and caches, up to 1,024 by default) one primitive per input shape: a first
call with a new row count took ~1.2 ms more than the next one (hidden 256, 2 threads),
and each cached primitive held ~0.55 MB of native memory. A server sees a new row count
with almost every prefill (the sum of the admitted prompts' lengths), so its memory grew
with the requests it served (~0.5 GB over a few thousand requests) and those prefills paid
the build each time. oneDNN calls therefore pad their rows up to `onednn_rows`: a ladder
of 30 shapes up to 2,048 rows, then multiples of 256, at most 25% extra rows above 16.
The padded rows are zeros and are cut off the result; on this project's hosts the real
rows came out bitwise equal to an unpadded call's (rows do not mix in a matmul).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from specops.kernels import cpu_linear

log = logging.getLogger(__name__)

ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
FP32_ONEDNN_FROM_ROWS = 3
_probe_cache: dict[tuple[str, torch.dtype], bool] = {}
# row counts oneDNN calls are padded to (module docstring); above the last, multiples of 256
# (fine below 64 rows: a Medusa tree's verification lands there, and small calls cost per row)
ONEDNN_ROW_LADDER = (12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                     640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN call over ``rows`` rows runs at (>= rows; one of few shapes)."""
    for top in ONEDNN_ROW_LADDER:
        if rows <= top:
            return top
    return -(-rows // 256) * 256


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` [N, K] with zero rows appended up to ``rows``."""
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here and agrees with `mm` (probed once per dtype)."""
    if device.type != "cpu" or dtype not in ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    key = (device.type, dtype)
    if key not in _probe_cache:
        _probe_cache[key] = _probe(dtype)
    return _probe_cache[key]


def _probe(dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 16, generator=gen).to(dtype)  # [out, in]
    bias = torch.randn(24, generator=gen).to(dtype)  # [out]
    x = torch.randn(3, 16, generator=gen).to(dtype)  # [N, in]
    other = torch.randn(3, 24, generator=gen).to(dtype)  # [N, out]
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            plain = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            summed = torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, "add")
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        log.info("oneDNN prepacked linear unavailable (%s); using MKL mm only", exc)
        return False
    want = torch.addmm(bias.float(), x.float(), weight.float().t())  # [N, out]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    ok = torch.allclose(plain.float(), want, atol=tol, rtol=tol) and torch.allclose(
        summed.float(), want + other.float(), atol=tol, rtol=tol
    )
    if not ok:
        log.warning("oneDNN prepacked linear disagrees with mm for %s; using MKL mm only", dtype)
    return ok


class PackedLinear:
    """y = x @ W^T + b, with W in the C kernel's panel layout (``weight``) for calls up to
    its rows, prepacked for oneDNN (``packed``, when `onednn` is set) for calls with more,
    and input-major [in, out] (``weight_t``) for MKL where neither takes a call. The weights
    are copies: changing the source module afterwards does not change this layer."""

    __slots__ = ("weight_t", "weight", "bias", "packed", "out_features", "packed_from_rows", "kernel_rows")

    def __init__(self, weight: Tensor, bias: Tensor | None, *, onednn: bool, cpu_kernel: bool | None = None,
                 kernel_bf16: bool = False) -> None:
        """``weight`` [out, in]. ``cpu_kernel``: use `cpu_linear` for up to MAX_ROWS rows (None:
        when it is built and the weight is fp32 on CPU). ``kernel_bf16``: the C kernel's copy
        in bfloat16 (half the bytes per call; a drafter's choice, see `FastLlamaRunner`),
        where the kernel reads it; the torch paths keep fp32."""
        if cpu_kernel is None:
            cpu_kernel = weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_linear.available()
        kernel_bf16 = kernel_bf16 and cpu_kernel and cpu_linear.bf16_weights()
        with torch.no_grad():
            weight = weight.detach()
            self.bias = None if bias is None else bias.detach().clone().contiguous()  # [out]
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if onednn else None
            kernel_dtype = torch.bfloat16 if kernel_bf16 else weight.dtype
            # [out, in] in the C kernel's panel layout (`cpu_linear.pack`): only that kernel reads it
            self.weight = cpu_linear.pack(weight.to(kernel_dtype)) if cpu_kernel else None
            # [in, out] for MKL's mm, for rows above the kernel's that oneDNN does not take
            self.weight_t = None if cpu_kernel and not kernel_bf16 and onednn else weight.t().contiguous()
        self.kernel_rows = cpu_linear.MAX_ROWS if cpu_kernel else 0
        self.out_features = weight.shape[0]
        # rows from which oneDNN is used: fp32 measured (thread CPU time, the bundled target's 33
        # matrices, 1 thread): 2 rows mm 2.82 ms vs oneDNN 3.05; 3 rows 3.20 vs 2.45; 4 rows 3.28 vs 2.31
        self.packed_from_rows = 1 if weight.dtype == torch.bfloat16 else FP32_ONEDNN_FROM_ROWS

    @classmethod
    def fuse(cls, linears, *, onednn: bool, kernel_bf16: bool = False) -> PackedLinear:
        """One layer computing several nn.Linear layers side by side (outputs concatenated)."""
        weight = torch.cat([m.weight.detach() for m in linears], dim=0)  # [sum(out), in]
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat(
                [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in linears]
            )  # [sum(out)]
        return cls(weight, bias, onednn=onednn, kernel_bf16=kernel_bf16)

    def __call__(self, x: Tensor) -> Tensor:  # [N, in] -> [N, out]
        rows = x.shape[0]
        if rows <= self.kernel_rows:
            return cpu_linear.unchecked(x.contiguous(), self.weight, self.bias, None, None, None, 0.0, False)
        if self.packed is not None and rows >= self.packed_from_rows:
            padded = onednn_rows(rows)
            return torch.ops.mkldnn._linear_pointwise(_pad_rows(x, padded), self.packed, self.bias, "none", [],
                                                      "")[:rows]
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def normed(self, x: Tensor, norm: Tensor, eps: float) -> Tensor:  # [N, in] -> [N, out]
        """``self(F.rms_norm(x, norm, eps))``, the norm inside the C kernel's call when it runs."""
        if x.shape[0] <= self.kernel_rows:
            return cpu_linear.unchecked(x.contiguous(), self.weight, self.bias, None, None, norm, eps, False)
        return self(F.rms_norm(x, (x.shape[-1],), norm, eps))

    def swiglu_add_to(self, residual: Tensor, gate_up: Tensor) -> Tensor:  # [N, out], [N, 2 in] -> [N, out]
        """``residual + (silu(gate) * up) @ W^T + b`` for ``gate_up`` = gate | up."""
        if gate_up.shape[0] <= self.kernel_rows:
            return cpu_linear.unchecked(gate_up.contiguous(), self.weight, self.bias, residual.contiguous(), None,
                                        None, 0.0, True)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.add_to(residual, F.silu(gate) * up)

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:  # residual [N, out], x [N, in] -> [N, out]
        """residual + x @ W^T + b, the add fused into the matmul."""
        rows = x.shape[0]
        if rows <= self.kernel_rows:
            return cpu_linear.unchecked(x.contiguous(), self.weight, self.bias, residual.contiguous(), None, None,
                                        0.0, False)
        if self.packed is not None and rows >= self.packed_from_rows:
            padded = onednn_rows(rows)
            return torch.ops.mkldnn._linear_pointwise.binary(_pad_rows(x, padded), _pad_rows(residual, padded),
                                                             self.packed, self.bias, "add")[:rows]
        out = torch.addmm(residual, x, self.weight_t)
        return out if self.bias is None else out.add_(self.bias)
