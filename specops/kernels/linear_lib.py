"""The CPU kernels' shared library (``linear.c``, a unity build of gemv.c, attention.c,
pool.c, layers.c, sample.c, verify.c and medusa.c): where it is loaded from and its C
functions' ctypes signatures. The wrapper modules call it: `cpu_linear` (the linear layer,
the pool, argmax), `cpu_attention`, `cpu_layers` (whole layer-stack forwards and drafting),
`cpu_medusa`, `cpu_steps` (one-call decoding steps) and `cpu_verify`.

Loaded like `specops.kernels.cpu_paged` (`specops.kernels.cbuild`: the prebuilt variant for
this CPU where an image ships one, else built with the system C compiler, ``-O3
-march=native``, into a cache keyed by the compiler's target features, every source file and
the flags; loaded with ctypes, which releases the GIL; `loaded_from` says which). Neither, a
failed build, or ``SPECOPS_CPU_KERNELS=0``: `available()` is False and callers keep their
torch paths.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from specops.kernels.cbuild import LazyKernel

SOURCE = Path(__file__).with_name("linear.c")

_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int


def _declare(lib: ctypes.CDLL, name: str, restype: type | None, argtypes: list) -> None:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes


def _setup(lib: ctypes.CDLL) -> None:
    # gemv.c
    _declare(lib, "specops_linear", _INT, [_PTR] * 5 + [_I64] * 3 + [_INT, _INT, _PTR, _F32])
    _declare(lib, "specops_bf16_weights", _INT, [])
    # pool.c
    _declare(lib, "specops_pool_workers", _INT, [])
    _declare(lib, "specops_pool_last_threads", _INT, [])
    # attention.c
    _declare(lib, "specops_attention", _INT,
             [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR] + [_I64] * 6 + [_F32, _PTR, _INT])
    _declare(lib, "specops_rope_cache_attention", _INT,
             [_PTR] * 5 + [_I64] * 3 + [_PTR] + [_I64] * 5 + [_F32, _PTR, _INT])
    # layers.c
    _declare(lib, "specops_llama_layers", _INT,
             [_PTR, _I64, _PTR] + [_I64] * 6 + [_F32, _F32, _PTR, _PTR] + [_I64] * 3 + [_PTR, _PTR, _INT] +
             [_PTR] * 3 + [_I64] + [_PTR] * 2 + [_INT, _I64, _PTR])
    _declare(lib, "specops_llama_draft", _INT,
             [_PTR, _I64, _PTR, _PTR] + [_I64] * 2 + [_PTR] + [_I64] * 5 + [_F32, _F32] + [_PTR] * 2 +
             [_I64] * 3 + [_PTR, _INT] + [_PTR] * 3 + [_I64] + [_PTR] * 2 + [_INT, _PTR] +
             [_PTR, _F32, _PTR, _PTR])
    _declare(lib, "specops_paged_layers", _INT,
             [_PTR, _I64, _PTR] + [_I64] * 6 + [_F32, _F32] + [_PTR] * 3 + [_I64] + [_PTR] * 3 + [_I64] * 2 +
             [_PTR] * 2 + [_I64] + [_PTR, _INT] + [_PTR] * 3 + [_I64, _PTR, _I64] + [_PTR] * 2 + [_INT])
    _declare(lib, "specops_paged_draft", _INT,
             [_PTR, _I64, _PTR, _PTR, _I64] + [_PTR] * 4 + [_I64] * 7 + [_F32, _F32] + [_PTR] * 4 + [_INT] +
             [_PTR] * 3 + [_I64] + [_PTR] * 2 + [_INT, _PTR, _I64, _INT, _PTR] + [_PTR] * 4)
    # sample.c
    _declare(lib, "specops_argmax_rows", None, [_PTR, _I64, _I64, _PTR])
    # verify.c
    _declare(lib, "specops_verify_sampled", None,
             [_PTR] * 3 + [_I64] * 2 + [_F32, _PTR, ctypes.c_double, _PTR, _PTR, _PTR])
    _declare(lib, "specops_chain_verify", _INT, [_PTR, _I64, _I64, _PTR, _PTR])
    # medusa.c
    _declare(lib, "specops_medusa_candidates", _INT,
             [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _INT, _PTR, _PTR, _INT, _I64, _I64, _PTR, _PTR, _INT,
              _I64, _PTR, _I64, _PTR, _INT])
    _declare(lib, "specops_medusa_step", _INT,
             [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR])


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


def weight_flags(weight: Tensor) -> int:
    """The C calls' weight flag for ``weight``: `WEIGHTS_BF16` for bfloat16, else 0."""
    return WEIGHTS_BF16 if weight.dtype == torch.bfloat16 else 0
