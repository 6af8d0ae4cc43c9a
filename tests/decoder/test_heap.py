"""`specops.models.heap`: the loaded models kept out of full garbage-collection passes."""

from __future__ import annotations

import gc

from specops.models.heap import frozen_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_a_frozen_block_keeps_its_objects_out_of_collections_and_gives_them_back_after():
    assert gc.get_freeze_count() == 0
    survivor = _Node()
    with frozen_heap() as count:
        assert count > 0 and gc.get_freeze_count() > 0
        garbage = _Node()
        del garbage
        assert gc.collect() >= 1  # a cycle made after the freeze is still collected
        assert gc.get_freeze_count() > count // 2  # the frozen ones stayed frozen (some may have died since)
    assert gc.get_freeze_count() == 0  # back in the collector's care
    del survivor
    assert gc.collect() >= 1  # the cycle alive at the freeze is collected once unfrozen


def test_a_full_collection_under_the_freeze_does_not_walk_the_frozen_objects():
    hoard = [[i] for i in range(200_000)]  # tracked containers, like a loaded model's
    with frozen_heap():
        tracked = len(gc.get_objects())
    assert tracked < 200_000  # get_objects lists the collector's generations, not the permanent one
    del hoard
