"""A draft model with a shorter context than the target's never shortens a request: drafting
stops where the sequence outgrows the draft, the rest decodes plainly (``fallback_reason ==
"draft_context"``), and greedy output equals plain decoding, in `Decoder.generate` (sync,
async pipeline, auto) and in the server's engine."""

from __future__ import annotations

import pytest
import torch

from specops.decoder import Decoder
from specops.models.loading import load_runner
from specops.spec.speculation import DRAFT_CONTEXT, draft_room
from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings
from tests.decoder.tiny_models import perturbed, tiny_other

DRAFT_CONTEXT_LEN = 24


@pytest.fixture(scope="module")
def dec():
    torch.set_num_threads(1)
    target = tiny_other("qwen2", seed=31, vocab=96)
    draft = load_runner(perturbed(target, noise=0.05, seed=32), max_context=DRAFT_CONTEXT_LEN)
    return Decoder(target, draft=draft)


def test_draft_room_counts_the_pending_token_and_drafts_but_the_last():
    assert draft_room(24, 10) == 15
    assert draft_room(24, 25) == 0 and draft_room(24, 40) == 0


@pytest.mark.parametrize("prompt_len", [10, 30])  # drafts, then outgrows the draft; longer than it from the start
@pytest.mark.parametrize("options", [{}, {"pipeline": "async"}])
def test_generate_draft_decodes_past_the_drafts_context(dec, prompt_len, options):
    prompt = [(5 * i + 1) % 96 for i in range(prompt_len)]
    want = dec.generate(prompt, method="ar", max_new_tokens=30).tokens
    out = dec.generate(prompt, method="draft", gamma=3, max_new_tokens=30, **options)
    assert out.tokens == want and len(out.tokens) == 30
    assert out.stats.fallback_reason == DRAFT_CONTEXT
    assert (out.stats.drafted > 0) == (prompt_len < DRAFT_CONTEXT_LEN)


def test_generate_auto_decodes_past_the_drafts_context(dec):
    prompt = [(7 * i + 2) % 96 for i in range(30)]
    out = dec.generate(prompt, method="auto", max_new_tokens=20)
    assert out.tokens == dec.generate(prompt, method="ar", max_new_tokens=20).tokens


def test_engine_serves_a_prompt_longer_than_the_drafts_context(dec):
    eng = Engine(dec, max_batch=2, kv_cache_mb=1, block_size=4, calibrate=False)
    prompts = {"long": [(3 * i + 4) % 96 for i in range(30)], "grows": [(3 * i + 5) % 96 for i in range(12)]}
    for rid, p in prompts.items():
        eng.add(rid, p, SamplingParams(max_tokens=30), SpecSettings(method="draft", gamma=3))
    got: dict[str, list[int]] = {}
    records = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                records[out.request_id] = out.record
    for rid, p in prompts.items():
        assert got[rid] == dec.generate(p, method="ar", max_new_tokens=30).tokens, rid
        assert len(got[rid]) == 30
    assert records["long"].fallback_reason == DRAFT_CONTEXT
