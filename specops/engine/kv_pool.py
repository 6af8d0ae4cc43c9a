"""Fixed-budget block bookkeeping for a paged KV cache.

The cache of one model is ``num_blocks`` blocks of ``block_size`` token slots each (the
storage tensor lives with the model, `specops.models.paged_llama`); a sequence owns a
*block table*, the list of its block ids in position order, so position ``p`` lives in
slot ``table[p // block_size] * block_size + p % block_size``.

Rules the engine relies on:

* `grow` is all-or-nothing: either the table covers the asked slots afterwards or nothing
  was taken (a step never runs on a partial allocation);
* `shrink` hands blocks past the kept slots back at once (rejected speculative entries);
* `release` hands back a whole table (finish, abort, preemption);
* ``used + free == total`` always; a block's reference count is the number of tables
  holding it.

Prefix caching (optional, nano-vllm's scheme): a full block whose KV is final is
registered under a chained hash (previous block's hash + its token ids; a hit also
compares the token ids). A new request reuses the cached blocks of its prompt's longest
full-block prefix, except the block of its last token (that KV is rewritten each step),
so shared blocks are never written. Freed blocks keep their hash until handed out again.
Only committed tokens are ever published, never drafts.
"""

from __future__ import annotations

from typing import Callable


def blocks_for(slots: int, block_size: int) -> int:
    """Blocks needed to hold ``slots`` token slots."""
    return -(-slots // block_size)


class BlockPool:
    """Block ids with reference counts, a free list, and (optionally) a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order: oldest freed first
        self._ref = [0] * num_blocks
        self._hash: dict[int, int] = {}  # block -> chained hash of its (final) contents
        self._cached: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # hash -> (block, previous hash, its tokens)
        self.peak_used = 0
        self.cache_hits = 0  # blocks reused from the prefix cache

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_slots(self) -> int:
        return self.num_blocks * self.block_size

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def missing(self, table: list[int], slots: int) -> int:
        """Blocks ``table`` still lacks to cover ``slots`` slots."""
        return max(0, blocks_for(slots, self.block_size) - len(table))

    def can_grow(self, table: list[int], slots: int) -> bool:
        return self.missing(table, slots) <= len(self._free)

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def _drop(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None  # keeps its hash: reusable until the block is handed out again

    def grow(self, table: list[int], slots: int) -> bool:
        """Extend ``table`` to cover ``slots`` slots; False (and nothing taken) when blocks lack."""
        need = self.missing(table, slots)
        if need > len(self._free):
            return False
        for _ in range(need):
            block = next(iter(self._free))
            h = self._hash.pop(block, None)
            if h is not None and self._cached.get(h, (None,))[0] == block:
                del self._cached[h]  # evicted from the prefix cache
            self._take(block)
            table.append(block)
        self.peak_used = max(self.peak_used, self.num_used)
        return True

    def shrink(self, table: list[int], slots: int) -> None:
        """Give back the blocks of ``table`` past the first ``slots`` slots."""
        keep = blocks_for(slots, self.block_size)
        while len(table) > keep:
            self._drop(table.pop())

    def release(self, table: list[int]) -> None:
        """Give back every block of ``table`` (left empty)."""
        for block in reversed(table):
            self._drop(block)
        table.clear()

    # -- prefix cache: only committed tokens whose KV is final ---------------------------
    def _chain(self, prev: int, tokens: tuple[int, ...]) -> int:
        return hash((prev, tokens))

    def publish(self, table: list[int], tokens: list[int], computed: int, published: int) -> int:
        """Register the full blocks of ``table`` below ``computed`` (their KV is final: later
        steps only write at or after the pending token); returns the new published count.

        Every published block records its chain hash, registered in the cache or not: a block
        whose contents another block already caches still carries the chain on to the next."""
        if not self.prefix_caching:
            return published
        bs = self.block_size
        full = min(computed // bs, len(table))
        prev = self._hash[table[published - 1]] if published else 0  # every published block has one
        for i in range(published, full):
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            h = self._chain(prev, toks)
            self._hash[table[i]] = h
            if h not in self._cached:
                self._cached[h] = (table[i], prev, toks)
            prev = h
        return max(published, full)

    def block_hash(self, block: int) -> int | None:
        """The chain hash a published block carries (None: not published since it was handed out)."""
        return self._hash.get(block)

    def match(self, table: list[int], tokens: list[int], max_blocks: int,
              usable: Callable[[int], bool] | None = None) -> int:
        """Append to an empty ``table`` the cached blocks of the longest prefix of ``tokens``
        (at most ``max_blocks`` full blocks; with ``usable``, only while it accepts each block's
        chain hash); returns how many were reused."""
        if not self.prefix_caching or table:
            return 0
        bs = self.block_size
        prev = 0
        for i in range(min(max_blocks, len(tokens) // bs)):
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            h = self._chain(prev, toks)
            entry = self._cached.get(h)
            if entry is None or entry[1] != prev or entry[2] != toks or (usable is not None and not usable(h)):
                break
            self._take(entry[0])
            table.append(entry[0])
            prev = h
        self.cache_hits += len(table)
        self.peak_used = max(self.peak_used, self.num_used)
        return len(table)
