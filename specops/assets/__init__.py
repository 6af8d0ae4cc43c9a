"""The bundled models (trained by ``specops train tiny``; see ``train_report.json``).

Layout::

    specops/assets/
      tokenizer.json, tokenizer_config.json   byte-level BPE shared by every model
      target/    Llama target (fp16 safetensors, loads as float32)
      draft/     draft distilled from the target (same vocabulary)
      medusa/    Medusa heads for the target (added by ``specops train heads``)
      train_report.json                       how they were made and measured
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
TARGET_DIR = ASSETS_DIR / "target"
DRAFT_DIR = ASSETS_DIR / "draft"
MEDUSA_DIR = ASSETS_DIR / "medusa"
TOKENIZER_DIR = ASSETS_DIR
REPORT_PATH = ASSETS_DIR / "train_report.json"
# Everything shipped under specops/assets/ must fit in this many bytes.
SIZE_BUDGET_BYTES = 32 * 1024 * 1024


def assets_size_bytes(root: Path = ASSETS_DIR) -> int:
    """Total size of the files under ``root`` (excluding Python caches)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
