"""PackedLinear (the fast runner's matmuls) equals F.linear for one row (MKL path) and for
several rows (oneDNN prepacked path, when usable here), with and without bias and with
the residual add fused in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specops.models.packed_linear import ONEDNN_ROW_LADDER, PackedLinear, onednn_rows, onednn_usable
from tests.decoder.test_runner import one_thread  # noqa: F401  (autouse fixture)

ONEDNN = onednn_usable(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("onednn", [False, pytest.param(True, marks=pytest.mark.skipif(not ONEDNN, reason="no oneDNN"))])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 7, 9, 23, 130, 2100])
def test_packed_linear_matches_f_linear(onednn, bias, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(40, 24, generator=gen)  # [out, in]
    b = torch.randn(40, generator=gen) if bias else None
    x = torch.randn(rows, 48, generator=gen)[:, ::2]  # [N, in], strided like a view of a bigger tensor
    residual = torch.randn(rows, 40, generator=gen)
    layer = PackedLinear(weight, b, onednn=onednn)
    with torch.inference_mode():
        got = layer(x)
        summed = layer.add_to(residual, x)
    want = F.linear(x, weight, b)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed, residual + want, atol=1e-5, rtol=1e-5)


def test_onednn_row_ladder_is_short_and_pads_little():
    """A server's prefills come in every row count; oneDNN builds and keeps a primitive (~0.5 MB)
    per shape, so the counts it sees must be few, and the padding small."""
    seen = {onednn_rows(r) for r in range(1, 4097)}
    assert len(seen) <= len(ONEDNN_ROW_LADDER) + 8  # 2,304 .. 4,096 in steps of 256
    for r in range(1, 4097):
        got = onednn_rows(r)
        assert got >= r and (r <= 16 or got <= 1.25 * r), (r, got)


@pytest.mark.skipif(not ONEDNN, reason="no oneDNN")
def test_onednn_calls_see_only_ladder_shapes(monkeypatch):
    """Every row count from 9 to 600 reaches oneDNN as one of the ladder's few shapes, and the
    caller gets exactly its own rows back, equal to an unpadded matmul."""
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(12, 8, generator=gen), torch.randn(12, generator=gen)
    layer = PackedLinear(weight, bias, onednn=True)
    shapes = set()
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, x, *args):
            shapes.add(x.shape[0])
            return real(x, *args)

        def binary(self, x, other, *args):
            shapes.add(x.shape[0])
            assert other.shape[0] == x.shape[0]
            return real.binary(x, other, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Spy())
    with torch.inference_mode():
        for rows in range(9, 601, 7):
            x = torch.randn(rows, 8, generator=gen)
            residual = torch.randn(rows, 12, generator=gen)
            got, summed = layer(x), layer.add_to(residual, x)
            assert got.shape == (rows, 12) and summed.shape == (rows, 12) and got.is_contiguous()
            want = F.linear(x, weight, bias)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(summed, residual + want, atol=1e-5, rtol=1e-5)
    assert shapes and shapes <= set(ONEDNN_ROW_LADDER), shapes


def test_fuse_concatenates_outputs_and_fills_missing_bias():
    gen = torch.Generator().manual_seed(0)
    first, second = torch.nn.Linear(8, 5, bias=True), torch.nn.Linear(8, 3, bias=False)
    x = torch.randn(3, 8, generator=gen)
    fused = PackedLinear.fuse([first, second], onednn=ONEDNN)
    with torch.no_grad():
        want = torch.cat([first(x), second(x)], dim=-1)  # [3, 8]
        torch.testing.assert_close(fused(x), want, atol=1e-5, rtol=1e-5)
        first.weight.add_(1.0)  # a snapshot: later changes to the module do not leak in
        torch.testing.assert_close(fused(x), want, atol=1e-5, rtol=1e-5)


def test_onednn_is_never_used_off_cpu_or_for_unsupported_dtypes():
    assert not onednn_usable(torch.device("meta"), torch.float32)
    assert not onednn_usable(torch.device("cpu"), torch.float64)


@pytest.mark.skipif(not onednn_usable(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16")
@pytest.mark.parametrize("rows", [1, 4])
def test_packed_linear_bfloat16(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(40, 24, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    x = torch.randn(rows, 24, generator=gen).bfloat16()
    residual = torch.randn(rows, 40, generator=gen).bfloat16()
    layer = PackedLinear(weight, bias, onednn=True)
    with torch.inference_mode():
        got, summed = layer(x), layer.add_to(residual, x)
    want = F.linear(x.float(), weight.float(), bias.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.02)
    torch.testing.assert_close(summed.float(), residual.float() + want, atol=0.1, rtol=0.02)
