"""Tiny tokenizer + random-weight Llama pair for the train / bench tests (seconds to build)."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    'def greet(name):\n    """Say hello to someone by name."""\n    return "hello " + name\n',
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
] * 4


def tiny_tokenizer(vocab_size: int = 320):
    from specops.train.tokenizer import train_tokenizer

    return train_tokenizer(CORPUS, vocab_size=vocab_size, min_frequency=1)


def tiny_llama(vocab_size: int, *, layers: int = 2, hidden: int = 32, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init: fewer near-ties, clearer argmax
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    return model


def save_pair(root: Path, *, target_layers: int = 2) -> tuple[Path, Path, object]:
    """Save a tiny target + 1-layer draft (random) with a shared tokenizer under ``root``."""
    from specops.train.checkpoint import save_fp16

    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), layers=target_layers, seed=0)
    draft = tiny_llama(len(tok), layers=1, seed=1)
    save_fp16(target, root / "target", tokenizer=tok)
    save_fp16(draft, root / "draft", tokenizer=tok)
    return root / "target", root / "draft", tok
