"""EAGLE drafter checkpoints: EAGLE's published layouts, EAGLE-1 (read and written) and EAGLE-3 (read).

An EAGLE-1 drafter folder holds ``config.json`` (a LlamaConfig-style dict with
``num_hidden_layers`` 1 and ``bias`` for ``fc``, as EAGLE's own; specops adds its fields under
``specops_eagle``) and the weights as ``model.safetensors`` (EAGLE-1 releases ship
``pytorch_model.bin``, which loads too) with EAGLE's tensor names::

    fc.weight, fc.bias                              [E, 2E], [E]
    layers.0.self_attn.{q,k,v,o}_proj.weight
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight
    layers.0.input_layernorm.weight                 (specops drafters; EAGLE-1's first layer has none)
    shortlist                                       (specops: token ids drafted over, optional)

An ``embed_tokens.weight`` in an EAGLE-1 file is ignored: the drafter reads the target's
embedding and LM head (`specops.models.eagle_model.EagleDrafter`).

An EAGLE-3 folder (`specops.models.eagle3_model.Eagle3Drafter`; recognised by
``draft_vocab_size`` in its config.json or by ``midlayer.*`` / ``d2t`` / ``t2d`` tensors) holds
the same two files with EAGLE-3's names::

    fc.weight [, fc.bias]                           [E, 3E_t]: three target hidden states fused
    midlayer.self_attn.{q,k,v}_proj.weight          [H*D, 2E] (embedding and feature side by side)
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight
    norm.weight, lm_head.weight                     [E], [F, E]: the drafter's own head over F tokens
    d2t [F] long, t2d [V] bool                      draft token k is target token k + d2t[k]
    embed_tokens.weight                             [V, E], optional (else the target's embedding)

and config keys ``vocab_size`` (the target's V), ``draft_vocab_size`` (F), optionally
``target_hidden_size`` (E_t, default E) and ``eagle_aux_hidden_state_layer_ids`` (top level or
under ``eagle_config``: the target ``hidden_states`` indices fused; default EAGLE's inputs of
layers 2, L // 2 and L - 3). ``d2t`` / ``t2d`` may be absent only when F == V. An EAGLE-3
drafter reads intermediate hidden states, which only the transformers runner returns
(`Decoder` picks it for ``impl="auto"``); the serving engine runs EAGLE-1 drafters only.
Anything malformed or inconsistent is an `EagleError` naming the tensor or key.

A trained drafter for a registered model lives in ``$SPECOPS_CACHE_DIR/eagle/NAME``
(`default_dir`), where ``specops train eagle --model NAME`` writes it and
``Decoder.from_pretrained(NAME)`` finds it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specops.models.eagle3_model import FUSED_LAYERS, Eagle3Config, Eagle3Drafter
from specops.models.eagle_model import FORMAT_VERSION, EagleConfig, EagleDrafter, EagleError

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

    if not isinstance(drafter, EagleDrafter):
        raise EagleError(f"save_drafter writes EAGLE-1 drafters (EagleDrafter), got {type(drafter).__name__}; "
                         "an EAGLE-3 drafter's folder is its published checkpoint")
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


def is_eagle3(config: dict, names) -> bool:
    """Whether a checkpoint (its config.json dict and tensor names) is in EAGLE-3's layout."""
    names = [k.removeprefix("ea_layer.") for k in names]
    return ("draft_vocab_size" in config or any(k in EAGLE3_MARKERS for k in names)
            or any(k.startswith("midlayer.") for k in names))


def is_eagle3_dir(path: str | Path) -> bool:
    """Whether a drafter folder holds an EAGLE-3 checkpoint (its config.json, and the tensor names
    of a ``model.safetensors``, read without loading the weights)."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    names: list[str] = []
    if (path / WEIGHTS_NAME).is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(path / WEIGHTS_NAME), framework="pt") as f:
                names = list(f.keys())
        except Exception:  # an unreadable file: load_drafter names the problem
            names = []
    return isinstance(config, dict) and is_eagle3(config, names)


def drafter_from_state(config: dict, state: dict[str, torch.Tensor], *,
                       source: str = "<checkpoint>") -> EagleDrafter | Eagle3Drafter:
    """An (unbound) drafter from a config.json dict and a state dict in EAGLE-1's or EAGLE-3's layout."""
    if not isinstance(config, dict):
        raise EagleError(f"{source}: config.json must hold a JSON object")
    state = {k.removeprefix("ea_layer."): v for k, v in state.items()}
    if is_eagle3(config, state):
        return eagle3_from_state(config, state, source=source)
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


def _rope_linear_factor(config: dict) -> float:
    """The RoPE position divisor of an EAGLE-3 config's ``rope_scaling`` (EAGLE's drafters know
    "linear" and "dynamic"; dynamic NTK scaling only changes positions past
    ``max_position_embeddings``, which the drafter never reaches)."""
    scaling = config.get("rope_scaling")
    if scaling is None:
        return 1.0
    kind = scaling.get("type", scaling.get("rope_type")) if isinstance(scaling, dict) else None
    if kind in ("default", "dynamic"):
        return 1.0
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if kind == "linear" and isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 0:
        return float(factor)
    raise EagleError(f"rope_scaling {scaling!r} is not supported (none, linear with a positive factor, "
                     "or dynamic)")


def _layer_ids(config: dict) -> Any:
    for holder in (config, config.get("eagle_config")):
        if isinstance(holder, dict) and holder.get("eagle_aux_hidden_state_layer_ids") is not None:
            ids = holder["eagle_aux_hidden_state_layer_ids"]
            if not isinstance(ids, list):
                raise EagleError(f"eagle_aux_hidden_state_layer_ids must be a list of layer indices, got {ids!r}")
            return tuple(ids)
    return None


EAGLE3_TENSORS = (
    "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight",
)
EAGLE3_OPTIONAL = ("fc.bias", "embed_tokens.weight", *EAGLE3_MARKERS)


def eagle3_from_state(config: dict, state: dict[str, torch.Tensor], *, source: str = "<checkpoint>") -> Eagle3Drafter:
    """An (unbound) EAGLE-3 drafter from a config.json dict and a state dict in EAGLE-3's layout."""
    where = f"{source} (EAGLE-3)"
    if config.get("num_hidden_layers", 1) != 1:
        raise EagleError(f"{where}: {config.get('num_hidden_layers')} drafter layers; EAGLE-3 drafters have 1")
    if config.get("hidden_act", "silu") != "silu":
        raise EagleError(f"{where}: hidden_act {config.get('hidden_act')!r}; only silu is supported")
    missing = sorted(set(EAGLE3_TENSORS) - set(state))
    extra = sorted(set(state) - set(EAGLE3_TENSORS) - set(EAGLE3_OPTIONAL))
    if missing or extra:
        raise EagleError(f"{where}: tensors do not match EAGLE-3's layout (missing {missing}, unexpected {extra})")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        vocab = int(config["vocab_size"])
        if "draft_vocab_size" not in config:
            raise EagleError("config.json has no draft_vocab_size (the rows of lm_head)")
        cfg = Eagle3Config(
            hidden_size=hidden, intermediate_size=int(config["intermediate_size"]), num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads), vocab_size=vocab,
            draft_vocab_size=int(config["draft_vocab_size"]),
            target_hidden_size=int(config.get("target_hidden_size") or hidden),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(config),
            rope_linear_factor=_rope_linear_factor(config),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            feature_layers=_layer_ids(config), fc_bias="fc.bias" in state,
            own_embedding="embed_tokens.weight" in state,
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, EagleError):
            raise EagleError(f"{where}: {exc}") from None
        raise EagleError(f"{where}: bad or missing config field: {exc}") from None
    state = dict(state)
    d2t, t2d = _vocab_maps(cfg, state.get("d2t"), state.get("t2d"), where)
    state["d2t"], state["t2d"] = d2t, t2d
    drafter = Eagle3Drafter(cfg)
    for name, tensor in drafter.state_dict().items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            hint = ""
            if name == "fc.weight":
                hint = (f": fc fuses {FUSED_LAYERS} target hidden states of width {cfg.target_hidden_size} "
                        f"(target_hidden_size) into {cfg.hidden_size}")
            elif name == "lm_head.weight":
                hint = f": one row per draft token (draft_vocab_size {cfg.draft_vocab_size})"
            elif name == "embed_tokens.weight":
                hint = f": one row per target token (vocab_size {cfg.vocab_size})"
            raise EagleError(f"{where}: {name} has shape {tuple(state[name].shape)}, expected "
                             f"{tuple(tensor.shape)}{hint}")
    drafter.load_state_dict({k: t.float() if t.is_floating_point() else t for k, t in state.items()})
    return drafter


def _vocab_maps(cfg: Eagle3Config, d2t: torch.Tensor | None, t2d: torch.Tensor | None,
                where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked ``d2t`` [F] long and ``t2d`` [V] bool (the identity maps where F == V and they are absent)."""
    f, v = cfg.draft_vocab_size, cfg.vocab_size
    if d2t is None:
        if f != v:
            raise EagleError(f"{where}: no d2t tensor: a draft vocabulary of {f} of the {v} target tokens "
                             "needs d2t (draft token k is target token k + d2t[k])")
        d2t = torch.zeros(f, dtype=torch.long)
    if d2t.dim() != 1 or d2t.numel() != f or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise EagleError(f"{where}: d2t must hold {f} integer offsets (draft_vocab_size), got "
                         f"{d2t.dtype} of shape {tuple(d2t.shape)}")
    ids = torch.arange(f) + d2t.long()
    if f and (int(ids.min()) < 0 or int(ids.max()) >= v):
        raise EagleError(f"{where}: d2t maps draft tokens outside the target vocabulary of {v} tokens "
                         f"(to ids {int(ids.min())} .. {int(ids.max())}; vocab_size {v})")
    if ids.unique().numel() != f:
        raise EagleError(f"{where}: d2t maps two draft tokens to one target token")
    mask = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)
    if t2d is None:
        t2d = mask
    if t2d.dim() != 1 or t2d.numel() != v:
        raise EagleError(f"{where}: t2d must mark each of the vocab_size {v} target tokens, got shape "
                         f"{tuple(t2d.shape)}")
    t2d = t2d.bool()
    if not torch.equal(t2d, mask):
        raise EagleError(f"{where}: t2d marks {int(t2d.sum())} target tokens, which are not the {f} that d2t "
                         "maps the draft tokens to")
    return d2t.long(), t2d


def load_drafter(path: str | Path, *, base: Any = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> EagleDrafter | Eagle3Drafter:
    """A drafter folder (`save_drafter`'s, an EAGLE-1 or an EAGLE-3 release), bound to ``base`` when given."""
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
