"""The engine over a bfloat16 target (bf16 weights streamed by the C kernels): every method equals its plain decoding."""

from __future__ import annotations

import pytest
import torch

from specops.decoder import Decoder
from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings
from specops.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="needs the C kernels (a C compiler)")


def test_a_bf16_target_serves_every_method_exactly():
    dec = Decoder.from_pretrained("bundled", dtype=torch.bfloat16)
    assert dec.target.kernel_weights == "bf16"
    eng = Engine(dec, max_batch=4, kv_cache_mb=16)
    prompt = dec.tokenizer.encode("def parse_args(argv):\n    ")
    want = dec.generate(prompt, method="ar", max_new_tokens=32).tokens
    methods = ("ar", "ngram", "draft", "medusa")
    for m in methods:
        eng.add(m, prompt, SamplingParams(max_tokens=32), SpecSettings(method=m))
    got: dict[str, list[int]] = {}
    for _ in range(200):
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not eng.has_unfinished():
            break
    assert {m: got[m] for m in methods} == {m: want for m in methods}
