"""EAGLE drafter checkpoints: EAGLE's published (EAGLE-1) layout, read and written.

A drafter folder holds ``config.json`` (a LlamaConfig-style dict with ``num_hidden_layers``
1 and ``bias`` for ``fc``, as EAGLE's own; specops adds its fields under ``specops_eagle``)
and the weights as ``model.safetensors`` (EAGLE-1 releases ship ``pytorch_model.bin``,
which loads too) with EAGLE's tensor names::

    fc.weight, fc.bias                              [E, 2E], [E]
    layers.0.self_attn.{q,k,v,o}_proj.weight
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight
    layers.0.input_layernorm.weight                 (specops drafters; EAGLE-1's first layer has none)
    shortlist                                       (specops: token ids drafted over, optional)

An ``embed_tokens.weight`` in the file is ignored: the drafter reads the target's
embedding and LM head. EAGLE-3 checkpoints (``midlayer.*``, ``d2t`` / ``t2d`` vocabulary
maps, a 3E-wide ``fc``) are refused with `EagleError`.

A trained drafter for a registered model lives in ``$SPECOPS_CACHE_DIR/eagle/NAME``
(`default_dir`), where ``specops train eagle --model NAME`` writes it and
``Decoder.from_pretrained(NAME)`` finds it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specops.decoder.eagle_model import FORMAT_VERSION, EagleConfig, EagleDrafter, EagleError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"
REPORT_NAME = "eagle_report.json"
SPECOPS_KEY = "specops_eagle"
EAGLE3_MARKERS = ("d2t", "t2d")


def default_dir(name: str) -> Path:
    """Where the trained drafter of registered model ``name`` is cached (beside the models cache)."""
    from specops.models.registry import cache_root

    return cache_root().parent / "eagle" / name


def is_drafter_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / CONFIG_NAME).is_file() and any((path / n).is_file() for n in (WEIGHTS_NAME, LEGACY_WEIGHTS_NAME))


def config_dict(drafter: EagleDrafter, **extra: Any) -> dict:
    """The drafter's config.json: EAGLE's keys, then specops' fields under ``specops_eagle``."""
    c = drafter.config
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "num_hidden_layers": 1, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings, "bias": c.fc_bias,
        SPECOPS_KEY: {**c.to_dict(), **extra},
    }


def save_drafter(drafter: EagleDrafter, path: str | Path, *, dtype: torch.dtype = torch.float16,
                 report: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (``dtype``) [+ ``eagle_report.json``] into ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
             for k, t in drafter.state_dict().items()}
    save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt", "specops": "eagle"})
    (path / CONFIG_NAME).write_text(json.dumps(config_dict(drafter), indent=2) + "\n")
    if report is not None:
        (path / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return path


def _rope_theta(data: dict) -> float:
    params = data.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("rope_theta"), (int, float)):
        return float(params["rope_theta"])
    theta = data.get("rope_theta", 10000.0)
    return float(theta) if isinstance(theta, (int, float)) else 10000.0


def drafter_from_state(config: dict, state: dict[str, torch.Tensor], *, source: str = "<checkpoint>") -> EagleDrafter:
    """An (unbound) drafter from a config.json dict and a state dict in EAGLE-1's layout."""
    if not isinstance(config, dict):
        raise EagleError(f"{source}: config.json must hold a JSON object")
    state = {k.removeprefix("ea_layer."): v for k, v in state.items()}
    if ("draft_vocab_size" in config or any(k in state for k in EAGLE3_MARKERS)
            or any(k.startswith("midlayer.") for k in state)):
        raise EagleError(f"{source}: an EAGLE-3 checkpoint (fused 3-layer features, d2t/t2d vocabulary maps) "
                         "is not supported; use an EAGLE-1 checkpoint or `specops train eagle`")
    if config.get("num_hidden_layers", 1) != 1:
        raise EagleError(f"{source}: {config.get('num_hidden_layers')} drafter layers; only 1-layer drafters "
                         "(EAGLE-1's layout) are supported")
    if config.get("hidden_act", "silu") != "silu":
        raise EagleError(f"{source}: hidden_act {config.get('hidden_act')!r}; only silu is supported")
    ours = config.get(SPECOPS_KEY) or {}
    if ours.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
        raise EagleError(f"{source}: format_version {ours['format_version']} is newer than this specops ({FORMAT_VERSION})")
    biased = sorted(k for k in state if k.startswith("layers.0.") and k.endswith(".bias"))
    if biased:
        raise EagleError(f"{source}: attention / MLP biases ({', '.join(biased)}) are not supported")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        cfg = EagleConfig(
            hidden_size=hidden, intermediate_size=int(config["intermediate_size"]), num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads), vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(config),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            fc_bias="fc.bias" in state, input_layernorm="layers.0.input_layernorm.weight" in state,
            shortlist_size=int(state["shortlist"].numel()) if "shortlist" in state else 0,
            base_model=str(ours.get("base_model", "")), base_model_hash=str(ours.get("base_model_hash", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, EagleError):
            raise EagleError(f"{source}: {exc}") from None
        raise EagleError(f"{source}: bad or missing config field: {exc}") from None
    drafter = EagleDrafter(cfg)
    state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
    expected = drafter.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise EagleError(f"{source}: tensors do not match EAGLE's layout (missing {missing}, unexpected {extra})")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise EagleError(f"{source}: {name} has shape {tuple(state[name].shape)}, expected {tuple(tensor.shape)}")
    drafter.load_state_dict({k: t.float() if t.is_floating_point() else t.long() for k, t in state.items()})
    return drafter


def load_drafter(path: str | Path, *, base: Any = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> EagleDrafter:
    """A drafter folder (`save_drafter`'s, or an EAGLE-1 release), bound to ``base`` when given."""
    path = Path(path)
    if not is_drafter_dir(path):
        raise EagleError(f"{path} is not an EAGLE drafter folder (needs {CONFIG_NAME} and {WEIGHTS_NAME} "
                         f"or {LEGACY_WEIGHTS_NAME})")
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError) as exc:
        raise EagleError(f"{path / CONFIG_NAME}: {exc}") from None
    if (path / WEIGHTS_NAME).is_file():
        from safetensors.torch import load_file

        state = load_file(str(path / WEIGHTS_NAME))
    else:
        state = torch.load(str(path / LEGACY_WEIGHTS_NAME), map_location="cpu", weights_only=True)
    drafter = drafter_from_state(config, state, source=str(path)).to(device=device, dtype=dtype).eval()
    if base is not None:
        drafter.bind(base)
    return drafter
