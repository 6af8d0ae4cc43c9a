"""A table-driven runner for edge-case tests: next-token logits depend on the last token only.

It implements the `ModelRunner` protocol exactly (cache length bookkeeping, truncate,
position checks) and records every call, so tests can force precise accept/reject
patterns and check that rollback keeps the cache where the algorithm says.
"""

from __future__ import annotations

import torch


class TableRunner:
    """Logits at a position = ``table[token at that position]`` (a bigram model)."""

    def __init__(self, table: torch.Tensor, max_context: int = 64) -> None:  # table: [V, V]
        self.table = table.float()
        self.vocab_size = int(table.shape[0])
        self.max_context = max_context
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self._len = 0
        self.calls: list[tuple[str, int, int]] = []  # (op, cache_len before, T or new length)

    def reset(self, batch_size: int = 1) -> None:
        self._len = 0
        self.calls.append(("reset", 0, batch_size))

    @property
    def cache_len(self) -> int:
        return self._len

    def forward(self, input_ids, *, position_ids=None, tree_mask=None, need_hidden=False):
        from specops.models.runner import RunnerOutput

        b, t = input_ids.shape
        if self._len + t > self.max_context:
            raise ValueError("past max_context")
        self.calls.append(("forward", self._len, t))
        self._len += t
        logits = self.table[input_ids]  # [B, T, V]
        return RunnerOutput(logits=logits, hidden=None)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"truncate {length} outside [0, {self._len}]")
        self.calls.append(("truncate", self._len, length))
        self._len = length

    def compact(self, start, keep) -> None:  # not used by linear drafting
        raise NotImplementedError


def chain_table(vocab: int, successor: dict[int, int] | None = None, peak: float = 10.0) -> torch.Tensor:
    """Greedy table: token i is followed by ``successor.get(i, (i + 1) % vocab)``."""
    table = torch.zeros(vocab, vocab)  # [V, V]
    for i in range(vocab):
        table[i, (successor or {}).get(i, (i + 1) % vocab)] = peak
    return table
