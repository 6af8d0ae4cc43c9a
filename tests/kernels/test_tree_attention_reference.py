"""The PyTorch tree-attention reference against a naive per-node loop, plus the
wrapper's input checks and the Triton launch planner (no Triton execution here)."""

from __future__ import annotations

import pytest
import torch

from specops.kernels import tree_attention, tree_attention_reference
from specops.kernels.tree_attention import plan_launch, triton_interpreting
from tests.kernels.trees import (
    chain_parents,
    default_scale,
    mask_from_parents,
    naive_tree_attention,
    random_parents,
    wide_parents,
)

CASES = [
    # B, Hq, Hkv, T, L, D, tree
    (1, 2, 2, 1, 0, 8, "chain"),
    (1, 4, 4, 1, 17, 16, "chain"),
    (2, 4, 2, 6, 11, 8, "chain"),
    (1, 8, 2, 9, 0, 12, "wide"),
    (2, 6, 2, 7, 5, 16, "random"),  # GQA 3
    (1, 4, 1, 13, 23, 8, "random"),  # GQA 4
]


def _tree(kind: str, nodes: int, gen: torch.Generator) -> torch.Tensor:
    parents = {"chain": chain_parents, "wide": wide_parents}.get(kind)
    return mask_from_parents(parents(nodes) if parents else random_parents(nodes, gen))


@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-H{c[1]}/{c[2]}-T{c[3]}-L{c[4]}-D{c[5]}-{c[6]}" for c in CASES])
def test_reference_matches_naive_loop(case):
    batch, hq, hkv, nodes, prefix, head_dim, kind = case
    gen = torch.Generator().manual_seed(CASES.index(case))
    q = torch.randn(batch, hq, nodes, head_dim, generator=gen)
    k = torch.randn(batch, hkv, prefix + nodes, head_dim, generator=gen)
    v = torch.randn(batch, hkv, prefix + nodes, head_dim, generator=gen)
    mask = _tree(kind, nodes, gen)
    scale = default_scale(head_dim)
    got = tree_attention_reference(q, k, v, mask, scale)
    want = naive_tree_attention(q, k, v, mask, scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # the public entry point on CPU ("auto") is the reference, with the default scale
    torch.testing.assert_close(tree_attention(q, k, v, mask), got, atol=0, rtol=0)


def test_tree_mask_is_respected():
    """Changing a tree node the mask hides from node i must not change node i's output."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 8, generator=gen)
    k = torch.randn(1, 2, 9, 8, generator=gen)
    v = torch.randn(1, 2, 9, 8, generator=gen)
    mask = mask_from_parents([-1, 0, 0, 1])  # node 2 cannot see node 1 or 3
    base = tree_attention(q, k, v, mask, impl="torch")
    v2 = v.clone()
    v2[:, :, 5 + 1] += 10.0  # tree node 1
    moved = tree_attention(q, k, v2, mask, impl="torch")
    torch.testing.assert_close(moved[:, :, 2], base[:, :, 2])
    torch.testing.assert_close(moved[:, :, 0], base[:, :, 0])
    assert not torch.allclose(moved[:, :, 1], base[:, :, 1])
    assert not torch.allclose(moved[:, :, 3], base[:, :, 3])


def test_empty_row_without_prefix_is_zero():
    q = torch.randn(1, 1, 2, 8)
    k = torch.randn(1, 1, 2, 8)
    mask = torch.tensor([[True, False], [False, False]])
    out = tree_attention(q, k, k, mask, impl="torch")
    assert torch.all(out[0, 0, 1] == 0) and torch.isfinite(out).all()


def test_half_inputs_keep_dtype():
    q = torch.randn(1, 2, 3, 8, dtype=torch.float16)
    k = torch.randn(1, 1, 7, 8, dtype=torch.float16)
    out = tree_attention(q, k, k, mask_from_parents(chain_parents(3)))
    assert out.dtype == torch.float16 and out.shape == (1, 2, 3, 8)


def _args(**over):
    args = dict(q=torch.randn(1, 4, 3, 8), k=torch.randn(1, 2, 10, 8), v=torch.randn(1, 2, 10, 8),
                tree_mask=mask_from_parents(chain_parents(3)))
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(q=torch.randn(4, 3, 8)), "q must be 4-D"),
        (dict(q=torch.randn(1, 3, 3, 8)), "multiple of kv heads"),
        (dict(k=torch.randn(1, 2, 10, 4), v=torch.randn(1, 2, 10, 4)), "does not match q"),
        (dict(v=torch.randn(1, 2, 11, 8)), "same shape"),
        (dict(k=torch.randn(1, 2, 2, 8), v=torch.randn(1, 2, 2, 8)), "fewer than the 3 tree nodes"),
        (dict(tree_mask=torch.ones(3, 4, dtype=torch.bool)), r"\[T, T\]"),
        (dict(tree_mask=torch.ones(3, 3)), "must be bool"),
        (dict(q=torch.randn(1, 4, 3, 8, dtype=torch.float64)), "not supported"),
        (dict(k=torch.randn(1, 2, 10, 8, dtype=torch.float16)), "share a dtype"),
        (dict(q=torch.randn(1, 4, 300, 8), tree_mask=torch.ones(300, 300, dtype=torch.bool),
              k=torch.randn(1, 2, 300, 8), v=torch.randn(1, 2, 300, 8)), "tree nodes T"),
    ],
)
def test_bad_inputs_raise(over, message):
    with pytest.raises(ValueError, match=message):
        tree_attention(**_args(**over))


def test_bad_scale_and_impl_raise():
    with pytest.raises(ValueError, match="scale"):
        tree_attention(**_args(), scale=-1.0)
    with pytest.raises(ValueError, match="impl"):
        tree_attention(**_args(), impl="cuda")


@pytest.mark.skipif(triton_interpreting(), reason="the interpreter runs Triton on CPU")
def test_triton_on_cpu_needs_cuda():
    with pytest.raises(ValueError, match="needs CUDA"):
        tree_attention(**_args(), impl="triton")


def test_plan_fills_gpu_for_long_prefix():
    # issue's benchmark point: B=1, Hkv=8, GQA 4, T=64, L=16k on a 132-SM GPU
    plan = plan_launch(1, 8, 4, 64, 16384, 128, sm_count=132)
    programs = -(-64 // plan.block_t) * plan.num_splits * 8
    assert programs >= 132  # at least one full wave
    assert plan.block_m == 128 and plan.block_t == 32 and plan.block_d == 128
    assert plan.chunk_len % plan.block_n == 0
    assert plan.num_splits * plan.chunk_len >= 16384 > (plan.num_splits - 1) * plan.chunk_len
    # partial state (S * G * T rows of D fp32) stays below the K/V bytes (2 * L * D bf16)
    assert plan.num_splits * 4 * 64 * 128 * 4 <= 2 * 16384 * 128 * 2


def test_plan_short_prefix_and_small_shapes():
    assert plan_launch(1, 8, 4, 64, 0, 128, sm_count=132).num_splits == 1
    plan = plan_launch(1, 1, 1, 1, 100, 24, sm_count=132)
    assert plan.block_m == 16 and plan.block_d == 32 and plan.num_splits == 1
    plan = plan_launch(1, 2, 3, 5, 1000, 16, sm_count=4, num_splits=4)
    assert plan.block_m % 4 == 0 and plan.num_splits == 4
    with pytest.raises(ValueError, match="num_splits"):
        plan_launch(1, 2, 2, 5, 100, 16, sm_count=4, num_splits=0)
