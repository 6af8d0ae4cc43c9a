"""Byte-level BPE tokenizer for the bundled models (HF ``tokenizers``).

Byte-level means every byte sequence round-trips exactly (no unknown tokens), which
matters for source code: indentation and rare characters survive decode(encode(x)).
The result is saved as ``tokenizer.json`` + ``tokenizer_config.json`` so
``AutoTokenizer.from_pretrained(folder)`` loads it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpecialTokens:
    """Special tokens, given the first ids in the vocabulary in this order."""

    bos: str = "<|bos|>"
    eos: str = "<|eos|>"
    pad: str = "<|pad|>"

    def as_list(self) -> list[str]:
        return [self.bos, self.eos, self.pad]


def train_tokenizer(texts: Sequence[str], *, vocab_size: int = 4096, min_frequency: int = 2,
                    special: SpecialTokens = SpecialTokens()):
    """Train a byte-level BPE on ``texts``; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(special.as_list()):
        raise ValueError(f"vocab_size must be at least 259 (256 bytes + 3 special tokens), got {vocab_size}")
    if not texts:
        raise ValueError("no texts to train the tokenizer on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special.as_list(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    log.info("tokenizer trained: %d tokens", tok.get_vocab_size())
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special.bos,
        eos_token=special.eos,
        pad_token=special.pad,
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer, folder: str | Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ special tokens map) to ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def load_tokenizer(folder: str | Path):
    """Load a tokenizer saved by :func:`save_tokenizer` (or any HF tokenizer folder)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"no tokenizer.json / tokenizer_config.json in {folder}")
    return AutoTokenizer.from_pretrained(str(folder))
