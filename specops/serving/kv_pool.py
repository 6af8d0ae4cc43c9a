"""Fixed-budget block bookkeeping for a paged KV cache.

The cache of one model is ``num_blocks`` blocks of ``block_size`` token slots each (the
storage tensor lives with the model, `specops.decoder.paged_llama`); a sequence owns a
*block table*, the list of its block ids in position order, so position ``p`` lives in
slot ``table[p // block_size] * block_size + p % block_size``.

Rules the engine relies on:

* `grow` is all-or-nothing: either the table covers the asked slots afterwards or nothing
  was taken (a step never runs on a partial allocation);
* `shrink` hands blocks past the kept slots back at once (rejected speculative entries);
* `release` hands back a whole table (finish, abort, preemption);
* ``used + free == total`` always, and a block is in at most one table.

No prefix caching: blocks are never shared, so no reference counts are needed.
"""

from __future__ import annotations


def blocks_for(slots: int, block_size: int) -> int:
    """Blocks needed to hold ``slots`` token slots."""
    return -(-slots // block_size)


class BlockPool:
    """A free list of ``num_blocks`` block ids."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_slots(self) -> int:
        return self.num_blocks * self.block_size

    def missing(self, table: list[int], slots: int) -> int:
        """Blocks ``table`` still lacks to cover ``slots`` slots."""
        return max(0, blocks_for(slots, self.block_size) - len(table))

    def can_grow(self, table: list[int], slots: int) -> bool:
        return self.missing(table, slots) <= len(self._free)

    def grow(self, table: list[int], slots: int) -> bool:
        """Extend ``table`` to cover ``slots`` slots; False (and nothing taken) when blocks lack."""
        need = self.missing(table, slots)
        if need > len(self._free):
            return False
        for _ in range(need):
            table.append(self._free.pop())
        self.peak_used = max(self.peak_used, self.num_used)
        return True

    def shrink(self, table: list[int], slots: int) -> None:
        """Give back the blocks of ``table`` past the first ``slots`` slots."""
        keep = blocks_for(slots, self.block_size)
        while len(table) > keep:
            self._free.append(table.pop())

    def release(self, table: list[int]) -> None:
        """Give back every block of ``table`` (left empty)."""
        self._free.extend(reversed(table))
        table.clear()
