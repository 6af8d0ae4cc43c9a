"""PackedLinear (the fast runner's matmuls) equals F.linear for one row (MKL path) and for
several rows (oneDNN prepacked path, when usable here), with and without bias and with
the residual add fused in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specops.decoder.packed_linear import PackedLinear, onednn_usable
from tests.decoder.test_runner import one_thread  # noqa: F401  (autouse fixture)

ONEDNN = onednn_usable(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("onednn", [False, pytest.param(True, marks=pytest.mark.skipif(not ONEDNN, reason="no oneDNN"))])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 7])
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
