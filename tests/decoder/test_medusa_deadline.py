"""Medusa honours the decode deadline: past it, root-only steps = plain decoding, exactly."""

from __future__ import annotations

import pytest

from specops.decoder import Decoder


@pytest.fixture(scope="module")
def dec():
    return Decoder.from_pretrained("bundled")


PROMPT = "import os\n\ndef read_config(path):\n    "


def test_medusa_deadline_falls_back_to_plain_steps(dec):
    plain = dec.generate(PROMPT, method="ar", max_new_tokens=12)
    # a fixed tree: the cost-planned one may be root-only on a busy machine, and this test is about deadlines
    late = dec.generate(PROMPT, method="medusa", max_new_tokens=12, deadline_s=1e-9, tree="small")
    assert late.tokens == plain.tokens
    assert late.stats.fallback_reason == "deadline" and late.stats.drafted == 0
    assert late.stats.target_forwards == 1 + 12  # prefill, then one plain step per token
    on_time = dec.generate(PROMPT, method="medusa", max_new_tokens=12, deadline_s=3600.0, tree="small")
    assert on_time.tokens == plain.tokens and on_time.stats.fallback_reason is None
    assert on_time.stats.target_forwards < 12  # speculation did happen
