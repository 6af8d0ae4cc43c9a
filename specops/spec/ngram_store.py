"""A corpus n-gram table for the n-gram drafter: what usually follows, where the context has no match.

Prompt lookup (`specops.spec.ngram`) drafts only where the request's own text repeats;
elsewhere its step is one plain forward. An `NgramStore` fills those steps from a corpus
(retrieval-based drafting, as in REST, He et al. 2023): for every 2- and 3-token context
seen at least ``min_count`` times in the corpus it keeps the most frequent next token and
that token's share of the context's occurrences. A draft is a chain: the longest stored
context of the text's last tokens gives the next token, which joins the text, and so on
while the product of the shares stays at or above ``min_prob`` (so a chain is as long as
its estimated chance of being followed allows, never longer than asked).

The drafts are proposals like any other: verification keeps the output exactly the
target's (greedy) or its distribution (sampled). A store is built for one tokenizer
(`tokenizer_digest`), and a decoder refuses one built for another.

The bundled target's store (`specops/assets/target/ngram_store.npz`) is built by
``specops train ngram-store`` from the same standard-library training files as the
models; the benchmark prompts come from the held-out ``test/`` files, which it never saw.
Its three settings (orders 2-3, ``min_count`` 4, ``min_prob`` 0.2) were chosen by replaying
the bundled target's greedy continuations of held-out prompts drawn with another seed than
the benchmark's (``builtin_suite(kind, seed=7)``): they gave the most tokens per unit of
verify cost on both code and docstrings among orders 2-3 / 2-4 / 2-6, min_count 2 / 4 / 8 and
min_prob 0.1-0.3.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specops.spec.errors import InvalidRequestError, ModelLoadError

STORE_FILE = "ngram_store.npz"
"""A model folder's store, loaded with the model (`Decoder.from_pretrained`)."""
FORMAT_VERSION = 1
DEFAULT_ORDERS = (2, 3)
DEFAULT_MIN_COUNT = 4
DEFAULT_MIN_PROB = 0.2


def tokenizer_digest(tokenizer: Any) -> str:
    """A digest of the tokenizer's vocabulary (token -> id), which a store must match."""
    vocab = tokenizer.get_vocab()
    text = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _keys(stream: np.ndarray, order: int, vocab_size: int) -> np.ndarray:
    """The ``order``-token context ending at each position that has a next token, as int64."""
    n = len(stream) - order
    key = np.zeros(n, dtype=np.int64)
    for i in range(order):
        key = key * vocab_size + stream[i : i + n]
    return key


def _key(tokens: Sequence[int], vocab_size: int) -> int:
    key = 0
    for t in tokens:
        key = key * vocab_size + t
    return key


@dataclass
class StoreTable:
    """One order's entries, sorted by key: the context, its most frequent next token, that token's share."""

    keys: np.ndarray  # [E] int64
    next: np.ndarray  # [E] int32
    prob: np.ndarray  # [E] float32


class NgramStore:
    """Most frequent next token per corpus context of 2..``max(orders)`` tokens (see module doc)."""

    def __init__(self, tables: dict[int, StoreTable], *, vocab_size: int, tokenizer: str = "",
                 min_prob: float = DEFAULT_MIN_PROB, meta: dict[str, Any] | None = None) -> None:
        if not tables:
            raise ValueError("an n-gram store needs at least one order")
        if any(o < 1 for o in tables):
            raise ValueError(f"orders must be >= 1, got {sorted(tables)}")
        if vocab_size < 2 or vocab_size ** max(tables) >= 2 ** 63:
            raise ValueError(f"vocab_size {vocab_size} ** order {max(tables)} does not fit a 63-bit key")
        self.vocab_size = int(vocab_size)
        self.tokenizer = tokenizer
        self.min_prob = check_min_prob(min_prob)
        self.meta = dict(meta or {})
        self.tables = tables
        self.orders = tuple(sorted(tables, reverse=True))  # longest context first
        # lookups run once per drafted token on the decoding thread: dicts, not searchsorted
        self._lookup = {o: dict(zip(t.keys.tolist(), zip(t.next.tolist(), t.prob.tolist()))) for o, t in tables.items()}

    def __len__(self) -> int:
        return sum(len(t.keys) for t in self.tables.values())

    # -- building --------------------------------------------------------------------
    @classmethod
    def build(cls, stream: Sequence[int] | np.ndarray, *, vocab_size: int, orders: Sequence[int] = DEFAULT_ORDERS,
              min_count: int = DEFAULT_MIN_COUNT, tokenizer: str = "", min_prob: float = DEFAULT_MIN_PROB,
              meta: dict[str, Any] | None = None) -> NgramStore:
        """Count every context of each order in ``stream`` (one token stream) and keep those whose
        most frequent next token was seen at least ``min_count`` times."""
        arr = np.asarray(stream, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError("stream must be one flat sequence of token ids")
        if len(arr) and (arr.min() < 0 or arr.max() >= vocab_size):
            raise ValueError(f"stream holds token ids outside [0, {vocab_size})")
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ValueError(f"min_count must be an integer >= 1, got {min_count!r}")
        orders = sorted({int(o) for o in orders})
        if not orders or orders[0] < 1:
            raise ValueError(f"orders must be integers >= 1, got {orders}")
        tables: dict[int, StoreTable] = {}
        for order in orders:
            if len(arr) <= order:
                tables[order] = StoreTable(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32))
                continue
            keys = _keys(arr, order, vocab_size)
            pairs, counts = np.unique(np.stack([keys, arr[order:]], axis=1), axis=0, return_counts=True)
            # per context: rows sorted by key, then by count descending (ties: the smaller token id)
            idx = np.lexsort((pairs[:, 1], -counts, pairs[:, 0]))
            pairs, counts = pairs[idx], counts[idx]
            first = np.ones(len(pairs), dtype=bool)
            first[1:] = pairs[1:, 0] != pairs[:-1, 0]
            starts = np.flatnonzero(first)
            totals = np.add.reduceat(counts, starts)
            best, best_count = pairs[starts], counts[starts]
            keep = best_count >= min_count
            tables[order] = StoreTable(keys=best[keep, 0].astype(np.int64), next=best[keep, 1].astype(np.int32),
                                       prob=(best_count[keep] / totals[keep]).astype(np.float32))
        meta = dict(meta or {})
        meta.update(min_count=min_count, corpus_tokens=int(len(arr)))
        return cls(tables, vocab_size=vocab_size, tokenizer=tokenizer, min_prob=min_prob, meta=meta)

    # -- drafting --------------------------------------------------------------------
    def next_token(self, context: Sequence[int]) -> tuple[int, float] | None:
        """(the most frequent next token after the longest stored context of ``context``'s end, its
        share), or None when no order has one."""
        for order in self.orders:
            if len(context) < order:
                continue
            hit = self._lookup[order].get(_key(context[-order:], self.vocab_size))
            if hit is not None:
                return hit
        return None

    def chain(self, context: Sequence[int], count: int, min_prob: float | None = None) -> list[int]:
        """Up to ``count`` tokens, each the next token after the context and the chain so far, while
        the product of their shares stays >= ``min_prob`` (None: the store's)."""
        floor = self.min_prob if min_prob is None else min_prob
        out: list[int] = []
        tail = list(context[-max(self.orders):])
        p = 1.0
        while len(out) < count:
            hit = self.next_token(tail)
            if hit is None:
                break
            p *= hit[1]
            if p < floor:
                break
            out.append(hit[0])
            tail.append(hit[0])
        return out

    def check_tokenizer(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        """Raise ValueError unless this store was built for ``tokenizer`` (and ``vocab_size``)."""
        if vocab_size is not None and vocab_size != self.vocab_size:
            raise ValueError(f"the n-gram store was built for a vocabulary of {self.vocab_size}, "
                             f"the model has {vocab_size}")
        if tokenizer is not None and self.tokenizer and tokenizer_digest(tokenizer) != self.tokenizer:
            raise ValueError("the n-gram store was built with another tokenizer "
                             f"(digest {self.tokenizer}, this one {tokenizer_digest(tokenizer)})")

    # -- files -----------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.is_dir():
            path = path / STORE_FILE
        arrays: dict[str, np.ndarray] = {}
        for order, t in self.tables.items():
            arrays[f"keys{order}"] = t.keys
            arrays[f"next{order}"] = t.next.astype(np.int16 if self.vocab_size <= 32767 else np.int32)
            arrays[f"prob{order}"] = t.prob.astype(np.float16)
        header = {"format_version": FORMAT_VERSION, "vocab_size": self.vocab_size, "tokenizer": self.tokenizer,
                  "orders": sorted(self.tables), "min_prob": self.min_prob, "meta": self.meta}
        arrays["header"] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
        with open(path, "wb") as fh:
            np.savez_compressed(fh, **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> NgramStore:
        path = Path(path)
        if path.is_dir():
            path = path / STORE_FILE
        try:
            with np.load(path, allow_pickle=False) as data:
                header = json.loads(bytes(data["header"]).decode("utf-8"))
                if header.get("format_version") != FORMAT_VERSION:
                    raise ModelLoadError(f"{path}: n-gram store format {header.get('format_version')!r}, "
                                         f"this version reads {FORMAT_VERSION}")
                tables = {int(o): StoreTable(keys=data[f"keys{o}"].astype(np.int64), next=data[f"next{o}"].astype(np.int32),
                                             prob=data[f"prob{o}"].astype(np.float32)) for o in header["orders"]}
            # a header's bad value (vocab_size, min_prob, ...) is the file's fault, not the caller's
            return cls(tables, vocab_size=header["vocab_size"], tokenizer=header.get("tokenizer", ""),
                       min_prob=header.get("min_prob", DEFAULT_MIN_PROB), meta=header.get("meta"))
        except (OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"cannot read the n-gram store {path}: {exc}") from exc


def check_min_prob(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise InvalidRequestError(f"min_prob must be a number in (0, 1], got {value!r}")
    return float(value)


def store_in(folder: str | Path) -> NgramStore | None:
    """The store a model folder carries (`STORE_FILE`), or None."""
    path = Path(folder) / STORE_FILE
    return NgramStore.load(path) if path.is_file() else None
