"""Triton KV compaction vs the reference, run in Triton's CPU interpreter.

Run by ``test_triton_interpreter.py`` in a subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from specops.kernels import kv_compact
from specops.kernels.tree_attention import triton_interpreting
from tests.kernels.trees import naive_kv_compact

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1 (see test_triton_interpreter.py)")


def _random_keep(n_nodes: int, n_keep: int, gen: torch.Generator) -> list[int]:
    return sorted(torch.randperm(n_nodes, generator=gen)[:n_keep].tolist())


CASES = [
    # B, Hkv, Lmax, D, start, keep (None = random subset of 'nodes' with 'n' rows)
    (1, 1, 16, 16, 3, [0, 2, 3]),  # dst 4 is src of entry 1: overlap
    (2, 3, 40, 24, 5, [1, 2, 5, 6, 7]),  # odd D
    (1, 2, 300, 16, 7, None),  # > 64 kept rows: several row blocks
    (1, 1, 64, 200, 0, [0, 1, 3, 4, 9]),  # D=200: two head-dim slices
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[f"Lmax{c[2]}-D{c[3]}-start{c[4]}" for c in CASES])
def test_triton_matches_sequential_moves(case, dtype):
    batch, hkv, lmax, head_dim, start, keep = case
    gen = torch.Generator().manual_seed(CASES.index(case))
    if keep is None:
        keep = _random_keep(lmax - start, 150, gen)
    k = torch.randn(batch, hkv, lmax, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, hkv, lmax, head_dim, generator=gen).to(dtype)
    want_k, want_v = naive_kv_compact(k, start, keep), naive_kv_compact(v, start, keep)
    kv_compact(k, v, start, torch.tensor(keep), impl="triton")
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_position_major_cache_view_and_int32_keep():
    gen = torch.Generator().manual_seed(5)
    buf_k = torch.randn(2, 32, 4, 16, generator=gen)  # [B, Lmax, Hkv, D]
    buf_v = torch.randn(2, 32, 4, 16, generator=gen)
    keep = [1, 2, 6, 9]
    want_k = naive_kv_compact(buf_k.transpose(1, 2), 10, keep).transpose(1, 2)
    want_v = naive_kv_compact(buf_v.transpose(1, 2), 10, keep).transpose(1, 2)
    kv_compact(buf_k.transpose(1, 2), buf_v.transpose(1, 2), 10, torch.tensor(keep, dtype=torch.int32), impl="triton")
    assert torch.equal(buf_k, want_k) and torch.equal(buf_v, want_v)
