"""`load_runner`: the runner for a loaded transformers model — the compact fast path where it
runs the architecture exactly, else the generic transformers one."""

from __future__ import annotations

import logging

from specops.models.fast_llama import FastLlamaRunner
from specops.models.hf_runner import HFRunner
from specops.models.runner import FAST_MODEL_TYPES, IMPLS, ModelRunner, UnsupportedModelError

log = logging.getLogger(__name__)


def load_runner(model, *, max_context: int | None = None, impl: str = "auto",
                kernel_weights: str = "fp32") -> ModelRunner:
    """Wrap a loaded transformers causal LM in a runner.

    impl "auto": the compact `FastLlamaRunner` for llama / mistral / qwen2 configs it can
    run exactly, else `HFRunner`; "fast" or "hf" force one (forcing "fast" on a model it
    cannot run raises `UnsupportedModelError`). ``kernel_weights``: the fast runner's CPU
    kernel weights ("bf16" for a draft model, see `FastLlamaRunner`).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a transformers model with a .config, got {type(model).__name__}")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{config.model_type} is an encoder-decoder model; only decoder-only models run")

    if impl == "hf":
        return HFRunner(model, max_context=max_context)
    if impl == "fast":
        return FastLlamaRunner(model, max_context=max_context, kernel_weights=kernel_weights)
    if getattr(config, "model_type", None) in FAST_MODEL_TYPES:
        try:
            return FastLlamaRunner(model, max_context=max_context, kernel_weights=kernel_weights)
        except UnsupportedModelError as exc:
            log.info("fast path unavailable (%s); using HFRunner", exc)
    return HFRunner(model, max_context=max_context)
