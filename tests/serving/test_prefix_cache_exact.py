"""The prefix cache never hands a request KV computed at other positions: a block's chain
hash follows from every block before it, whether or not that earlier block was itself
registered, and greedy output with the cache equals single-request plain decoding whatever
prompts share, in any order and concurrency."""

from __future__ import annotations

import random

import pytest
import torch

from specops.decoder import Decoder
from specops.engine.engine import Engine
from specops.engine.kv_pool import BlockPool
from specops.engine.sequence import SamplingParams, SpecSettings
from tests.decoder.tiny_models import tiny_other


def test_a_chain_continues_through_a_block_another_block_already_caches():
    pool = BlockPool(8, 2, prefix_caching=True)
    a: list[int] = []
    pool.grow(a, 4)
    assert pool.publish(a, [1, 2, 3, 4], computed=4, published=0) == 2
    b: list[int] = []  # the same prompt computed again (not matched): its blocks' contents are cached already
    tokens = [1, 2, 3, 4, 5, 6, 7]
    pool.grow(b, 7)
    assert pool.publish(b, tokens, computed=4, published=0) == 2
    assert pool.publish(b, tokens, computed=6, published=2) == 3  # block (5, 6) sits at positions 4-5
    assert pool.match([], [5, 6, 9], max_blocks=1) == 0  # not a prompt that starts with (5, 6)
    c: list[int] = []
    assert pool.match(c, [1, 2, 3, 4, 5, 6, 9], max_blocks=3) == 3 and c == a + [b[2]]


def test_a_hit_compares_the_previous_hash_as_well_as_the_tokens():
    pool = BlockPool(8, 2, prefix_caching=True)
    a: list[int] = []
    pool.grow(a, 4)
    pool.publish(a, [1, 2, 3, 4], computed=4, published=0)
    h = pool._hash[a[1]]
    block, prev, toks = pool._cached[h]
    pool._cached[h] = (block, prev + 1, toks)  # as if another chain's hash collided with this one
    assert pool.match([], [1, 2, 3, 4, 5], max_blocks=2) == 1


@pytest.fixture(scope="module")
def dec():
    torch.set_num_threads(1)
    return Decoder(tiny_other("qwen2", seed=21, vocab=96))


def _run(eng: Engine, requests: list[tuple[str, list[int], int]], join_every: int) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    pending, steps = list(requests), 0
    while pending or eng.has_unfinished():
        if pending and steps % join_every == 0:
            rid, prompt, n = pending.pop(0)
            eng.add(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True), SpecSettings(method="ar"))
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        assert steps < 20_000
    return got


def test_a_prompt_cut_from_a_repeated_requests_output_decodes_like_plain(dec):
    """P with its output; P again (its last prompt block computed anew, identical to the cached
    one); then a prompt starting at P's output: it must not reuse the second request's output
    blocks as if they began a prompt."""
    bs = 4
    eng = Engine(dec, max_batch=4, kv_cache_mb=1, block_size=bs, calibrate=False, eos_token_id=None)
    rng = random.Random(3)
    prompt = [rng.randrange(96) for _ in range(3 * bs)]
    first = _run(eng, [("p1", prompt, 10)], 1)["p1"]
    _run(eng, [("p2", prompt, 10)], 1)
    hits = eng.pool.cache_hits
    third = (prompt + first)[3 * bs: 3 * bs + 10]
    got = _run(eng, [("p3", third, 8)], 1)["p3"]
    assert got == dec.generate(third, method="ar", max_new_tokens=8, eos_token_id=None).tokens
    assert eng.pool.cache_hits == hits  # nothing cached begins a prompt with those tokens


@pytest.mark.parametrize("seed", range(8))
def test_greedy_output_with_shared_block_runs_equals_single_request_ar(dec, seed):
    """Random prompt sets that share block-aligned runs (of earlier prompts and of their outputs)
    at random offsets, sent in a random order at a random concurrency, twice over (a cold cache, then
    warm ones): every greedy output equals single-request plain decoding."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    eng = Engine(dec, max_batch=rng.randint(1, 4), kv_cache_mb=1, block_size=bs, calibrate=False,
                 eos_token_id=None)

    def plain(p: list[int], n: int) -> list[int]:
        return dec.generate(p, method="ar", max_new_tokens=n, eos_token_id=None).tokens

    texts = []  # prompts with their plain outputs: the material later prompts are cut from
    requests = []
    for i in range(3):
        p = [rng.randrange(96) for _ in range(rng.randint(2, 5) * bs + rng.randrange(bs))]
        texts.append(p + plain(p, 4 * bs))
        requests.append((f"t{i}", p, 4 * bs))  # the prompts themselves, with long outputs
    for i in range(12):
        k = rng.randrange(3)
        src = texts[k]
        # half of them start inside an earlier request's output: blocks that request published as it decoded
        lo = len(requests[k][1]) // bs if rng.random() < 0.5 else 0
        start = bs * rng.randrange(lo, len(src) // bs - 1)
        prompt = src[start: start + rng.randint(bs + 1, len(src) - start)]
        if rng.random() < 0.3:
            prompt = prompt + [rng.randrange(96) for _ in range(rng.randint(1, 2 * bs))]
        requests.append((f"r{i}", prompt, rng.randint(1, 3 * bs)))
    for rnd in range(3):
        order = requests[:]
        rng.shuffle(order)
        got = _run(eng, [(f"{rid}.{rnd}", p, n) for rid, p, n in order], join_every=rng.randint(1, 3))
        for rid, prompt, n in requests:
            assert got[f"{rid}.{rnd}"] == plain(prompt, n), (rid, rnd)
    assert eng.pool.cache_hits > 0  # prompts really shared cached blocks
