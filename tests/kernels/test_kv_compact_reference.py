"""The PyTorch KV-compaction reference against sequential row moves, and the checks."""

from __future__ import annotations

import pytest
import torch

from specops.kernels import kv_compact, kv_compact_reference
from specops.kernels.tree_attention import triton_interpreting
from tests.kernels.trees import naive_kv_compact

CASES = [
    # start, keep  (keep[i] >= i; several overlap source and destination rows)
    (0, [0]),
    (3, [0, 2, 3]),
    (5, [1, 2, 5, 6, 7]),
    (2, [4]),
    (0, [0, 1, 2, 9, 10, 11]),
]


@pytest.mark.parametrize("start, keep", CASES)
def test_reference_matches_sequential_moves(start, keep):
    gen = torch.Generator().manual_seed(len(keep) * 31 + start)
    k = torch.randn(2, 3, 20, 5, generator=gen)
    v = torch.randn(2, 3, 20, 5, generator=gen)
    want_k, want_v = naive_kv_compact(k, start, keep), naive_kv_compact(v, start, keep)
    kv_compact_reference(k, v, start, torch.tensor(keep))
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_public_entry_on_cpu_and_untouched_rows():
    k = torch.arange(2 * 12 * 4, dtype=torch.float32).reshape(1, 2, 12, 4)
    v = -k
    before = k.clone()
    kv_compact(k, v, 4, torch.tensor([1, 3, 4]))
    assert torch.equal(k[:, :, 4:7], before[:, :, [5, 7, 8]])
    assert torch.equal(v[:, :, 4:7], -before[:, :, [5, 7, 8]])
    assert torch.equal(k[:, :, :4], before[:, :, :4])  # prefix untouched
    assert torch.equal(k[:, :, 7:], before[:, :, 7:])  # tail left for the caller to drop


def test_position_major_layout_through_a_view():
    """A [B, Lmax, Hkv, D] buffer passed as buf.transpose(1, 2)."""
    buf_k = torch.randn(1, 16, 3, 8)
    buf_v = torch.randn(1, 16, 3, 8)
    want = buf_k.clone()
    want[:, 2:5] = buf_k[:, [2 + 1, 2 + 4, 2 + 6]]
    kv_compact(buf_k.transpose(1, 2), buf_v.transpose(1, 2), 2, torch.tensor([1, 4, 6]))
    assert torch.equal(buf_k, want)


def test_identity_and_empty_keep_are_noops():
    k = torch.randn(1, 1, 8, 4)
    v = torch.randn(1, 1, 8, 4)
    k0 = k.clone()
    kv_compact(k, v, 2, torch.tensor([0, 1, 2]))
    kv_compact(k, v, 2, torch.tensor([], dtype=torch.long))
    assert torch.equal(k, k0)


@pytest.mark.parametrize(
    "start, keep, message",
    [
        (0, [1, 1], "strictly increasing"),
        (0, [2, 1], "strictly increasing"),
        (0, [-1, 2], ">= 0"),
        (5, [0, 3], "outside the cache"),
        (-1, [0], "start must be in"),
        (9, [0], "start must be in"),
    ],
)
def test_bad_keep_raises(start, keep, message):
    k = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match=message):
        kv_compact(k, k.clone(), start, torch.tensor(keep))


def test_bad_caches_raise():
    k = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="differs"):
        kv_compact(k, torch.randn(1, 1, 9, 4), 0, torch.tensor([1]))
    with pytest.raises(ValueError, match="dtypes differ"):
        kv_compact(k, k.half(), 0, torch.tensor([1]))
    with pytest.raises(ValueError, match="int64 or int32"):
        kv_compact(k, k.clone(), 0, torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"\[B, Hkv, Lmax, D\]"):
        kv_compact(k[0], k[0].clone(), 0, torch.tensor([1]))
    with pytest.raises(TypeError, match="start"):
        kv_compact(k, k.clone(), 1.5, torch.tensor([1]))


@pytest.mark.skipif(triton_interpreting(), reason="the interpreter runs Triton on CPU")
def test_triton_on_cpu_needs_cuda():
    k = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="needs CUDA"):
        kv_compact(k, k.clone(), 0, torch.tensor([2]), impl="triton")
