"""Triton paged attention vs the reference, run in Triton's CPU interpreter; and the paged
model's forward with its attention on that kernel against the SDPA path.

Run by ``test_triton_interpreter.py`` in a subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from specops.kernels.paged_attention import paged_attention
from specops.kernels.tree_attention import triton_interpreting
from tests.kernels.paged_cases import paged_steps, ragged_case

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1 (see test_triton_interpreter.py)")

SHAPES = [  # hq, hkv, d, (prefix, new) per sequence
    (4, 2, 16, ((5, 1), (30, 4), (0, 3), (17, 1))),
    (6, 6, 24, ((70, 1), (3, 2))),  # D not a power of two; more keys than a block
    (8, 1, 32, ((129, 5), (1, 1), (40, 8))),
]


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("shape", SHAPES, ids=["gqa", "mha-d24", "mqa"])
def test_triton_matches_the_reference(shape, tree):
    hq, hkv, d, seqs = shape
    args, want = ragged_case(SHAPES.index(shape), hq=hq, hkv=hkv, d=d, seqs=seqs, tree=tree)
    args["q_index"][args["visible"] == 0] = 0  # padded queries point at a real row: must not write it
    out = torch.full_like(want, float("nan"))
    paged_attention(**args, out=out, impl="triton")
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-4)


def test_fp16_inputs_accumulate_in_fp32():
    args, want = ragged_case(7, d=16, seqs=((50, 3), (9, 1)), dtype=torch.float16)
    out = torch.zeros(want.shape, dtype=torch.float16)
    paged_attention(**args, out=out, impl="triton")
    assert torch.allclose(out.float(), want, atol=2e-3, rtol=2e-3)


def test_the_paged_model_on_the_kernel_matches_sdpa():
    """`PagedLlama.forward` with `gpu_kernel` on (the path CUDA takes; here the interpreter runs
    the kernel on CPU tensors) gives the SDPA path's logits: plain steps, a chain draft, a tree."""
    from specops.models.fast_llama import FastLlamaRunner
    from specops.engine.batch_forward import PagedBackend
    from specops.engine.kv_pool import BlockPool
    from tests.decoder.tiny_models import tiny_llama

    runner = FastLlamaRunner(tiny_llama(seed=0))
    results = []
    for kernel in (False, True):
        pool = BlockPool(32, 4)
        backend = PagedBackend(runner, pool)
        backend.model.cpu_kernel = backend.model.c_layers = False  # the generic path, SDPA or the Triton kernel
        backend.model.gpu_kernel = kernel
        results.append(paged_steps(backend, pool))
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
