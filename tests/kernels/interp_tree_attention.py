"""Triton tree attention vs the PyTorch reference, run in Triton's CPU interpreter.

Not collected by a plain ``pytest`` run (the name does not start with ``test_``):
``test_triton_interpreter.py`` runs this file in a subprocess with
TRITON_INTERPRET=1, which must be set before Triton is first imported.
"""

from __future__ import annotations

import pytest
import torch

from specops.kernels import tree_attention
from specops.kernels.tree_attention import triton_interpreting
from tests.kernels.trees import chain_parents, mask_from_parents, random_parents, wide_parents

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1 (see test_triton_interpreter.py)")

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

CASES = [
    # B, Hq, Hkv, T, L, D, tree, num_splits (None = planner)
    (1, 2, 2, 1, 0, 16, "chain", None),  # T=1, L=0: only the node itself
    (1, 4, 4, 1, 45, 16, "chain", 2),  # T=1 (plain decode step), two prefix splits
    (2, 4, 2, 6, 37, 24, "chain", None),  # odd D (padded to 32), GQA 2
    (1, 8, 2, 11, 0, 16, "wide", None),  # wide tree, no prefix, GQA 4
    (1, 6, 2, 9, 70, 16, "random", 3),  # GQA 3 (not a power of two), three splits
    (1, 8, 2, 40, 19, 16, "random", None),  # 4 * 64 rows -> two tree-node blocks
    (2, 2, 1, 17, 130, 40, "wide", 2),  # GQA 2, D=40, ragged last split
]


def _inputs(case, dtype):
    batch, hq, hkv, nodes, prefix, head_dim, kind, _ = case
    gen = torch.Generator().manual_seed(CASES.index(case))
    parents = {"chain": chain_parents, "wide": wide_parents}.get(kind)
    mask = mask_from_parents(parents(nodes) if parents else random_parents(nodes, gen))
    q = torch.randn(batch, hq, nodes, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, hkv, prefix + nodes, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, hkv, prefix + nodes, head_dim, generator=gen).to(dtype)
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[f"H{c[1]}/{c[2]}-T{c[3]}-L{c[4]}-D{c[5]}-{c[6]}-S{c[7]}" for c in CASES])
def test_triton_matches_reference(case, dtype):
    q, k, v, mask = _inputs(case, dtype)
    got = tree_attention(q, k, v, mask, impl="triton", num_splits=case[-1])
    want = tree_attention(q, k, v, mask, impl="torch")
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_bfloat16_is_upcast_in_the_interpreter():
    q, k, v, mask = _inputs(CASES[4], torch.bfloat16)
    got = tree_attention(q, k, v, mask, impl="triton", num_splits=3)
    want = tree_attention(q, k, v, mask, impl="torch")
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_split_count_does_not_change_the_result(splits):
    q, k, v, mask = _inputs(CASES[6], torch.float32)
    want = tree_attention(q, k, v, mask, impl="torch")
    got = tree_attention(q, k, v, mask, impl="triton", num_splits=splits)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_strided_cache_views_and_custom_scale():
    """k/v as views of a larger preallocated cache, as the fast runner passes them."""
    gen = torch.Generator().manual_seed(11)
    nodes, prefix = 5, 21
    cache_k = torch.randn(2, 2, 64, 16, generator=gen)
    cache_v = torch.randn(2, 2, 64, 16, generator=gen)
    k, v = cache_k[:, :, : prefix + nodes], cache_v[:, :, : prefix + nodes]
    assert not k.is_contiguous()
    q = torch.randn(2, 4, nodes, 16, generator=gen)
    mask = mask_from_parents([-1, 0, 0, 1, 2])
    got = tree_attention(q, k, v, mask, scale=0.3, impl="triton")
    want = tree_attention(q, k.contiguous(), v.contiguous(), mask, scale=0.3, impl="torch")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_empty_row_without_prefix_gives_zeros_like_reference():
    q = torch.randn(1, 2, 3, 16)
    k = torch.randn(1, 1, 3, 16)
    mask = torch.tensor([[True, False, False], [False, False, False], [True, False, True]])
    got = tree_attention(q, k, k, mask, impl="triton")
    torch.testing.assert_close(got, tree_attention(q, k, k, mask, impl="torch"), atol=2e-5, rtol=2e-5)
    assert torch.all(got[:, :, 1] == 0)


def test_head_dim_must_be_contiguous():
    q = torch.randn(1, 2, 3, 16)
    k = torch.randn(1, 1, 16, 3).transpose(-1, -2)  # [1, 1, 3, 16] with stride(-1) != 1
    with pytest.raises(ValueError, match="contiguous in its last"):
        tree_attention(q, k, k, mask_from_parents(chain_parents(3)), impl="triton")
