"""Training and held-out text: the Python standard library of this interpreter.

The bundled models are trained on the stdlib's own source (present wherever Python
is), with every test folder kept out of training. Part of ``test/`` serves as the
held-out set: evaluation text and the benchmark's code prompts.

Everything here is deterministic: files are listed in sorted order and every random
choice takes an explicit seed.
"""

from __future__ import annotations

import functools
import logging
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

log = logging.getLogger(__name__)

# Folder names whose contents never enter training (tests, vendored packages).
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


class DataError(ValueError):
    """Raised for unusable training data (no files, too little text, bad paths)."""


@dataclass(frozen=True)
class StdlibSplit:
    """Source files of the standard library, split into training and held-out sets."""

    root: Path
    train_files: list[Path]
    heldout_files: list[Path]


def stdlib_root() -> Path:
    """The standard library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded(path: Path, root: Path) -> bool:
    return any(part in EXCLUDED_DIRS for part in path.relative_to(root).parts[:-1])


def split_stdlib(root: Path | None = None) -> StdlibSplit:
    """List ``*.py`` files under ``root``: training = outside all test folders,
    held-out = ``root/test/test_*.py`` (top level of the test package), both sorted."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise DataError(f"standard library folder not found: {root}")
    train = sorted(p for p in root.rglob("*.py") if not _is_excluded(p, root))
    heldout = sorted((root / "test").glob("test_*.py"))
    if not train:
        raise DataError(f"no training files (*.py outside test folders) under {root}")
    log.info("stdlib %s: %d training files, %d held-out files", root, len(train), len(heldout))
    return StdlibSplit(root=root, train_files=train, heldout_files=heldout)


@functools.lru_cache(maxsize=4)
def heldout_files(root: Path | None = None) -> tuple[Path, ...]:
    """``split_stdlib(root).heldout_files`` without listing the training files (a walk of the
    whole standard library, ~1 s): the benchmark suites need only these."""
    root = Path(root) if root is not None else stdlib_root()
    return tuple(sorted((root / "test").glob("test_*.py")))


def read_texts(files: Iterable[Path], *, max_bytes_per_file: int | None = None) -> list[str]:
    """Read files as UTF-8 (undecodable bytes replaced), skipping empty ones."""
    texts = []
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc}") from exc
        if max_bytes_per_file is not None:
            text = text[:max_bytes_per_file]
        if text.strip():
            texts.append(text)
    return texts


def encode_stream(texts: Sequence[str], tokenizer, *, eos_id: int) -> torch.Tensor:
    """Tokenize each text and join them, each followed by ``eos_id``.

    Returns: [N] long — one flat token stream.
    """
    if not texts:
        raise DataError("no text to encode")
    ids: list[int] = []
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None:  # fast path: batch-encode with the Rust tokenizer, no special tokens
        for enc in backend.encode_batch(list(texts), add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos_id)
    else:
        for text in texts:
            ids.extend(tokenizer.encode(text, add_special_tokens=False))
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


class TokenWindows:
    """Random fixed-length windows from a flat token stream (seeded)."""

    def __init__(self, stream: torch.Tensor, seq_len: int, *, seed: int = 0):  # stream: [N]
        if stream.dim() != 1:
            raise DataError(f"token stream must be 1-D, got shape {tuple(stream.shape)}")
        if seq_len < 2:
            raise DataError(f"seq_len must be >= 2, got {seq_len}")
        if stream.numel() <= seq_len + 1:
            raise DataError(f"token stream has {stream.numel()} tokens, need more than seq_len+1={seq_len + 1}")
        self.stream = stream
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int) -> torch.Tensor:
        """Returns: [B, seq_len + 1] long (inputs are [:, :-1], targets [:, 1:])."""
        high = self.stream.numel() - self.seq_len - 1
        starts = torch.randint(0, high + 1, (batch_size,), generator=self.generator)  # [B]
        offsets = torch.arange(self.seq_len + 1)  # [T+1]
        return self.stream[starts[:, None] + offsets[None, :]]  # [B, T+1]

    def sequential(self, batch_size: int, max_batches: int) -> Iterable[torch.Tensor]:
        """Non-overlapping windows from the start of the stream, for evaluation.

        Yields: [b, seq_len + 1] long, b <= batch_size.
        """
        n_windows = (self.stream.numel() - 1) // self.seq_len
        starts = list(range(0, n_windows * self.seq_len, self.seq_len))[: batch_size * max_batches]
        offsets = torch.arange(self.seq_len + 1)
        for i in range(0, len(starts), batch_size):
            s = torch.tensor(starts[i : i + batch_size])
            s = s[s + self.seq_len + 1 <= self.stream.numel()]
            if s.numel():
                yield self.stream[s[:, None] + offsets[None, :]]


def code_prompts(files: Sequence[Path], *, count: int = 20, max_chars: int = 600, seed: int = 0) -> list[str]:
    """Deterministic code prompts cut from held-out files: a seeded choice of files,
    and from each a run of whole lines starting at a seeded line, ending on a line
    boundary (so the continuation starts a new line)."""
    if count < 1:
        raise DataError(f"count must be >= 1, got {count}")
    rng = random.Random(seed)
    candidates = sorted(files)
    rng.shuffle(candidates)
    prompts: list[str] = []
    for path in candidates:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(lines) < 40:
            continue
        start = rng.randrange(0, len(lines) - 30)
        chunk = ""
        for line in lines[start:]:
            if len(chunk) + len(line) > max_chars:
                break
            chunk += line
        if len(chunk.strip()) >= 80:
            prompts.append(chunk)
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise DataError(f"only {len(prompts)} prompts found, {count} requested")
    return prompts
