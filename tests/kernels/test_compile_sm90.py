"""Compile the Triton kernels for an H100/H200 (sm_90) without a GPU.

Triton's NVIDIA backend lowers a kernel all the way to a cubin on any machine, so
CI checks what the GPU would run: the planned tilings compile, the tree-attention
dots use Hopper tensor cores (wgmma) with a software-pipelined K/V loop, shared
memory fits an SM, and (``cuobjdump -res-usage``) 16-bit variants do not spill.

Integer arguments that are multiples of 16 (pointers, strides, the chunk length)
are marked divisible by 16, as Triton's JIT specialises them at launch.

CI must run this (no GPU needed: the pip Triton wheel that torch pins ships the NVIDIA
backend with ``ptxas`` and ``cuobjdump``): under ``SPECOPS_REQUIRE_SERVICES=1`` a
missing Triton, NVIDIA backend or ``cuobjdump``, or ``TRITON_INTERPRET=1`` in the
environment (kernels interpreted, never compiled) fails the run; elsewhere those skip
with the reason (`tests.services`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.services import REQUIRE_SERVICES, require_file, require_module

triton = require_module("triton", "compiling the kernels for sm_90")
require_module("triton.backends.nvidia", "compiling the kernels for sm_90")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import specops.kernels  # noqa: E402,F401  (registers the submodules below)

ta = sys.modules["specops.kernels.tree_attention"]
kc = sys.modules["specops.kernels.kv_compact"]
pa = sys.modules["specops.kernels.paged_attention"]

if ta.triton_interpreting():
    if REQUIRE_SERVICES:
        pytest.fail("TRITON_INTERPRET=1 is set: CI must compile the kernels for sm_90, unset it", pytrace=False)
    pytest.skip("kernels are interpreted (TRITON_INTERPRET=1), not compiled, here", allow_module_level=True)

SM90 = GPUTarget("cuda", 90, 32)
MAX_SHARED = 227 * 1024  # per-block opt-in limit on sm_90
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
TRITON_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _compile(fn, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict, aligned: set[str], **options):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in aligned or name in pointers}
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=SM90, options=options)


def _resources(kernel, tmp_path) -> dict[str, int]:
    require_file(CUOBJDUMP, "checking register spills of the sm_90 cubins")
    path = tmp_path / "k.cubin"
    path.write_bytes(kernel.asm["cubin"])
    out = subprocess.run([CUOBJDUMP, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return {key: int(val) for key, val in re.findall(r"(REG|STACK|LOCAL):(\d+)", out)}


def _split_kernel(dtype, group, nodes, prefix, head_dim, heads_kv=8):
    plan = ta.plan_launch(1, heads_kv, group, nodes, prefix, head_dim, sm_count=132,
                          elem_bytes=torch.empty((), dtype=dtype).element_size())
    consts = ta.split_kernel_constexprs(plan, group, head_dim, dtype, upcast=False, write_final=plan.num_splits == 1)
    t = "*" + TRITON_TYPE[dtype]
    pointers = dict(Q=t, K=t, V=t, O=t, MASK="*u8", M_OUT="*fp32", L_OUT="*fp32", ACC_OUT="*fp32")
    fn = ta._tree_attn_split_kernel
    aligned = {n for n in fn.arg_names if n.startswith("stride_") and n != "stride_mask"} | {"chunk_len"}
    kernel = _compile(fn, pointers, ("qk_scale",), consts, aligned, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return plan, kernel


@pytest.mark.parametrize(
    "dtype, group, nodes, prefix, head_dim, mma",
    [
        (torch.bfloat16, 4, 64, 16384, 128, "wgmma"),  # the benchmark's goal point: 128-row warpgroup MMA
        (torch.float16, 1, 16, 4096, 64, "mma.sync"),  # no GQA, 16 rows: too few for wgmma, still tensor cores
    ],
    ids=["bf16-G4-T64-L16k-D128", "fp16-G1-T16-L4k-D64"],
)
def test_split_kernel_uses_tensor_cores_pipelined_without_spills(dtype, group, nodes, prefix, head_dim, mma, tmp_path):
    plan, kernel = _split_kernel(dtype, group, nodes, prefix, head_dim)
    assert plan.num_splits > 1  # the long prefix is split across the GPU
    assert mma in kernel.asm["ptx"]
    assert "async_copy_global_to_local" in kernel.asm["ttgir"]  # K/V tiles prefetched
    assert kernel.metadata.shared <= MAX_SHARED
    usage = _resources(kernel, tmp_path)
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, usage


def test_float32_split_kernel_fits_shared_memory():
    _, kernel = _split_kernel(torch.float32, 4, 64, 4096, 128)
    assert kernel.metadata.shared <= MAX_SHARED


def test_reduce_and_compact_kernels_compile(tmp_path):
    reduce = _compile(
        ta._tree_attn_reduce_kernel, dict(M_IN="*fp32", L_IN="*fp32", ACC_IN="*fp32", O="*bf16"), (),
        dict(BLOCK_T=64, BLOCK_D=128, HEAD_DIM=128), {"stride_ob", "stride_oh", "stride_ot"}, num_warps=4,
    )
    assert _resources(reduce, tmp_path)["STACK"] == 0
    compact = _compile(
        kc._kv_compact_kernel, dict(K="*bf16", V="*bf16", KEEP="*i64"), (),
        dict(HEAD_DIM=128, BLOCK_R=16, BLOCK_D=128),
        {"stride_kb", "stride_kh", "stride_kl", "stride_vb", "stride_vh", "stride_vl"}, num_warps=4,
    )
    assert "bar.sync" in compact.asm["ptx"]  # the load/store barrier survived lowering
    assert _resources(compact, tmp_path)["STACK"] == 0


@pytest.mark.parametrize("dtype, hq, hkv, head_dim, has_mask", [
    (torch.bfloat16, 32, 8, 128, False),  # a Llama-3-8B-shaped layer, plain / chain steps
    (torch.bfloat16, 32, 8, 128, True),  # the same with a tree's mask
    (torch.float32, 4, 2, 64, False),  # the bundled target's layer shape in fp32
], ids=["bf16-G4-D128", "bf16-G4-D128-tree", "fp32-G2-D64"])
def test_paged_attention_kernel_compiles_without_spills(dtype, hq, hkv, head_dim, has_mask, tmp_path):
    t = "*" + TRITON_TYPE[dtype]
    pointers = dict(Q=t, K=t, V=t, O=t, QIDX="*i64", VIS="*i64", SLOTS="*i64", MASK="*u8" if has_mask else "*i64")
    consts = pa.kernel_constexprs(hq, hkv, head_dim, has_mask)
    kernel = _compile(pa._paged_attn_kernel, pointers, ("qk_scale",), consts,
                      {"stride_qn", "stride_qh", "stride_ks", "stride_kh", "stride_on"}, num_warps=4)
    assert kernel.metadata.shared <= MAX_SHARED
    usage = _resources(kernel, tmp_path)
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, usage
