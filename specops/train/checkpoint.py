"""Save trained models compactly: fp16 safetensors that load back as float32.

fp16 halves the shipped size; converting fp16 -> fp32 on load is exact, so a model
loaded from the folder is bit-identical to the saved fp16 weights in fp32. The config
records ``dtype: float32`` so ``AutoModelForCausalLM.from_pretrained(folder)`` gives a
float32 model by default.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def save_fp16(model, folder: str | Path, *, tokenizer=None) -> Path:
    """Write ``model`` (any HF model) as fp16 safetensors + config (dtype float32)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to(torch.float16)
    half.save_pretrained(str(folder), safe_serialization=True)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "float32"
    config.setdefault("dtype", "float32")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    log.info("saved %s (%.1f MB)", folder, size / 1e6)
    return folder


def load_causal_lm(path: str | Path, *, dtype: torch.dtype = torch.float32):
    """Load an HF causal LM for training/evaluation (eval mode, given dtype)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model (config.json) at {path}")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval()


def count_parameters(model) -> int:
    """Unique parameters (tied weights counted once)."""
    seen = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel()
    return sum(seen.values())
