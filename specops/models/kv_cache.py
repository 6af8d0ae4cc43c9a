"""A preallocated KV cache with a length pointer.

All layers' keys and values live in one tensor `data [NL, 2, B, Hkv, S, D]` allocated
once (S = max_context). Appending writes into the next free slots, rollback moves the
length pointer, and compaction (keeping an accepted tree path) is one gather plus one
copy over every layer at once — no concatenation and no allocation per decoding step.

The cache does not advance itself inside `write`: a forward writes every layer's new
entries at the same offset and then calls `advance(T)` once.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Per-layer key/value storage [NL, 2, B, Hkv, S, D] plus the number of filled slots."""

    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        batch: int = 1,
    ) -> None:
        for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("max_len", max_len)):
            if value < 1:
                raise ValueError(f"KVCache {name} must be >= 1, got {value}")
        self.layers = layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.max_len = max_len
        self.dtype = dtype
        self.device = device
        self.length = 0
        self.batch = 0
        self.data = torch.empty(0, dtype=dtype, device=device)  # [NL, 2, B, Hkv, S, D]
        self.per_layer: list[Tensor] = []  # NL x [2, B, Hkv, S, D] views into data
        self.keys: list[Tensor] = []  # NL x [B, Hkv, S, D] views into data
        self.values: list[Tensor] = []  # NL x [B, Hkv, S, D] views into data
        self.reset(batch)

    def reset(self, batch: int = 1) -> None:
        """Empty the cache; reallocate only when the batch size changes."""
        if batch < 1:
            raise ValueError(f"KVCache batch must be >= 1, got {batch}")
        if batch != self.batch:
            shape = (self.layers, 2, batch, self.kv_heads, self.max_len, self.head_dim)
            self.data = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.per_layer = [self.data[i] for i in range(self.layers)]
            self.keys = [self.data[i, 0] for i in range(self.layers)]
            self.values = [self.data[i, 1] for i in range(self.layers)]
            self.batch = batch
        self.length = 0

    def write(self, layer: int, kv: Tensor) -> tuple[Tensor, Tensor]:  # kv: [2, B, Hkv, T, D]
        """Store T new entries of one layer after the filled ones; return its keys and values
        including them, each [B, Hkv, length + T, D]. Does not move the length pointer."""
        start = self.length
        new = kv.shape[-2]
        self.per_layer[layer].narrow(3, start, new).copy_(kv)
        return self.keys[layer].narrow(2, 0, start + new), self.values[layer].narrow(2, 0, start + new)

    def advance(self, count: int) -> None:
        """Mark `count` more entries as filled (after every layer wrote them)."""
        if self.length + count > self.max_len:
            raise ValueError(f"KVCache overflow: {self.length} + {count} > {self.max_len} slots")
        self.length += count

    def truncate(self, length: int) -> None:
        """Keep the first `length` entries."""
        if length < 0 or length > self.length:
            raise ValueError(f"KVCache truncate length must be in [0, {self.length}], got {length}")
        self.length = length

    def compact_ascending(self, start: int, keep: list[int]) -> None:
        """`compact` for strictly increasing offsets ``keep`` (keep[0] >= 0, start + keep[-1] <
        length; the caller checks): entry start + keep[i] moves to start + i, one copy per entry
        that moves (a Medusa path: node 0 and often node 1 stay put). In ascending order no
        entry is overwritten before it is read (keep[j] >= j > i for every later source)."""
        with torch.inference_mode():
            for i, k in enumerate(keep):
                if k != i:
                    self.data[:, :, :, :, start + i].copy_(self.data[:, :, :, :, start + k])
        self.length = start + len(keep)

    def compact(self, start: int, index: Tensor) -> None:  # index: [n] long, absolute positions
        """Move entry index[i] to start + i in every layer; the cache then holds start + n entries.

        The entries are gathered before they are written, so overlapping ranges are safe.
        """
        n = index.numel()
        if start + n > self.length:
            raise ValueError(f"KVCache compact: start {start} + {n} kept entries exceed length {self.length}")
        moved = self.data.index_select(4, index)  # [NL, 2, B, Hkv, n, D]
        self.data[:, :, :, :, start : start + n].copy_(moved)
        self.length = start + n
