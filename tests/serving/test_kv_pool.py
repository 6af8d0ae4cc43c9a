"""BlockPool: all-or-nothing growth, immediate give-back, no block lost or shared."""

from __future__ import annotations

import random

import pytest

from specops.engine.kv_pool import BlockPool, blocks_for


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_grow_is_all_or_nothing():
    pool = BlockPool(5, 4)
    a, b = [], []
    assert pool.grow(a, 9)  # 3 blocks
    assert len(a) == 3 and pool.num_free == 2
    assert not pool.grow(b, 12)  # needs 3, only 2 free: nothing taken
    assert b == [] and pool.num_free == 2
    assert pool.grow(b, 8) and pool.num_free == 0
    assert not pool.grow(a, 13)  # a needs a 4th block: refused, a unchanged
    assert len(a) == 3
    assert pool.grow(a, 12)  # already covered: nothing needed


def test_shrink_gives_blocks_back_at_once_and_release_empties():
    pool = BlockPool(6, 4)
    t = []
    pool.grow(t, 21)  # 6 blocks
    pool.shrink(t, 9)  # keep 3
    assert len(t) == 3 and pool.num_free == 3
    pool.shrink(t, 12)  # nothing past 12
    assert len(t) == 3
    pool.release(t)
    assert t == [] and pool.num_free == 6 and pool.peak_used == 6


def test_random_traffic_never_loses_or_shares_a_block():
    rng = random.Random(0)
    pool = BlockPool(32, 4)
    tables = [[] for _ in range(6)]
    for _ in range(2000):
        t = rng.choice(tables)
        op = rng.random()
        if op < 0.5:
            pool.grow(t, rng.randint(0, 60))
        elif op < 0.9:
            pool.shrink(t, rng.randint(0, 60))
        else:
            pool.release(t)
        owned = [b for tab in tables for b in tab]
        assert len(owned) == len(set(owned)) == pool.num_used
        assert pool.num_used + pool.num_free == 32
        assert all(0 <= b < 32 for b in owned)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 4)


def test_prefix_cache_match_publish_and_eviction():
    pool = BlockPool(4, 2, prefix_caching=True)
    a = []
    pool.grow(a, 5)  # 3 blocks for tokens [1..5]
    tokens = [1, 2, 3, 4, 5]
    assert pool.publish(a, tokens, computed=4, published=0) == 2  # two full blocks with final KV
    b = []
    assert pool.match(b, [1, 2, 3, 4, 9], max_blocks=2) == 2 and b == a[:2]
    assert pool.refcount(a[0]) == 2
    c = []
    assert pool.match(c, [1, 2, 7, 7], max_blocks=2) == 1  # second block's tokens differ
    f = []
    assert pool.match(f, [1, 2, 3, 4], max_blocks=1) == 1  # capped (the last token's block stays private)
    pool.release(f)
    pool.release(a)
    pool.release(b)
    pool.release(c)
    assert pool.num_used == 0
    d = []
    assert pool.match(d, tokens, max_blocks=2) == 2  # freed blocks stay cached
    pool.release(d)
    e = []
    pool.grow(e, 8)  # takes all 4 blocks: the cached ones are evicted
    pool.release(e)
    assert pool.match([], tokens, max_blocks=2) == 0


def test_without_prefix_caching_nothing_is_shared():
    pool = BlockPool(4, 2)
    a = []
    pool.grow(a, 4)
    assert pool.publish(a, [1, 2, 3, 4], computed=4, published=0) == 0
    assert pool.match([], [1, 2, 3, 4], max_blocks=2) == 0
