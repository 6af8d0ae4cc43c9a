"""A bfloat16 target on the CPU runs on the C kernels with bf16 weights and fp32 arithmetic."""

from __future__ import annotations

import pytest
import torch

from specops.decoder import Decoder
from specops.models.fast_llama import FastLlamaRunner
from specops.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="needs the C kernels (a C compiler)")

PROMPT = "def parse_args(argv):\n    "


@pytest.fixture(scope="module")
def dec():
    return Decoder.from_pretrained("bundled", dtype=torch.bfloat16)


def test_a_bf16_target_streams_bf16_weights_on_the_fast_runner(dec):
    runner = dec.target
    assert isinstance(runner, FastLlamaRunner) and runner.kernel_weights == "bf16"
    # its logits are fp32 arithmetic on the bf16 weights: the bf16-rounded module's, up to summation order
    model = dec.target_model  # the bf16 module as loaded; the runner holds a float32 copy of its values
    assert next(model.parameters()).dtype == torch.bfloat16 and runner.model is not model
    ids = torch.tensor([dec.tokenizer.encode(PROMPT)])
    runner.reset(1)
    got = runner.forward(ids).logits[0]  # [T, V]
    with torch.inference_mode():
        want = runner.model(ids).logits[0]  # fp32 arithmetic on the bf16 values
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("method", ["ngram", "draft", "medusa", "auto"])
def test_speculation_on_a_bf16_target_equals_its_plain_decoding(dec, method):
    plain = dec.generate(PROMPT, method="ar", max_new_tokens=40)
    out = dec.generate(PROMPT, method=method, max_new_tokens=40)
    assert out.tokens == plain.tokens


def test_the_transformers_runner_keeps_a_bf16_target_as_loaded():
    from specops.assets import TARGET_DIR
    from specops.decoder.api import _bf16_kernel_target, _load_model

    model = _load_model(TARGET_DIR, dtype=torch.bfloat16, device="cpu", role="target")
    assert _bf16_kernel_target(model, impl="hf", max_context=None) is None
    assert isinstance(_bf16_kernel_target(model, impl="auto", max_context=None), FastLlamaRunner)
    fp32 = _load_model(TARGET_DIR, dtype=torch.float32, device="cpu", role="target")
    assert _bf16_kernel_target(fp32, impl="auto", max_context=None) is None  # fp32 runs as before
