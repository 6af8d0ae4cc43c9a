"""The EAGLE-3 drafter module (Li et al. 2025, arXiv 2503.01840), for published EAGLE-3 checkpoints.

Where an EAGLE-1 drafter (`specops.models.eagle_model`) reads the target's last hidden
state, an EAGLE-3 drafter reads three of the target's intermediate hidden states side by side
(a low, a middle and a high layer; by EAGLE's default the inputs of layers ``2``, ``L // 2``
and ``L - 3`` of an ``L``-layer target, i.e. transformers' ``hidden_states[2]``,
``[L // 2]`` and ``[L - 3]``), and drafts over a reduced vocabulary of its own:

    h_i   = fc([g_lo; g_mid; g_hi])                       (3E_t -> E, the fused feature)
    a     = attention(cat(input_layernorm(e(x_{i+1})), hidden_norm(h_i)))   (q/k/v read 2E)
    u     = h_i + o_proj(a)
    out_i = u + mlp(post_attention_layernorm(u))          (the predicted feature, E)
    logits = lm_head(norm(out_i))                          (over the F draft tokens)

Inside a drafted chain the layer reads its own previous output as ``h`` (E wide: ``fc`` is
skipped, as EAGLE's drafter does when the feature is already E wide). Draft token ``k`` is
target token ``k + d2t[k]``; ``t2d`` marks the target tokens that have one. The parameter
names are EAGLE-3's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so
`specops.models.eagle_io` loads a published state dict one to one.

The drafter offers `specops.spec.eagle.draft_chain`, `EagleCursor` and `EagleProposer` what
an EAGLE-1 drafter offers (`logits`, `step`, `new_cache`, `reset`, `truncate`, `max_context`,
and ``shortlist``: the target ids of its draft tokens, None when they are the whole vocabulary
in order), so both kinds run through one code path; `feature_layers` says which target hidden states `step`
reads (`specops.spec.speculation.TargetVerifier` keeps them: ``keep_features``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specops.models.eagle_model import DrafterCache, RMSNorm, EagleError, _MLP, _rotate

FUSED_LAYERS = 3  # target hidden states an EAGLE-3 drafter fuses


@dataclass(frozen=True)
class Eagle3Config:
    """Sizes of an EAGLE-3 drafter, as its config.json gives them."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """The target's vocabulary (rows of ``t2d`` and of the embedding)."""
    draft_vocab_size: int
    """Tokens the drafter ranks (rows of ``lm_head``, entries of ``d2t``)."""
    target_hidden_size: int
    """Width of each fused target hidden state (``fc`` reads three of them)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_linear_factor: float = 1.0
    """Positions are divided by this before RoPE (``rope_scaling`` type "linear"; 1: none)."""
    max_position_embeddings: int = 2048
    feature_layers: tuple[int, ...] | None = None
    """The target's ``hidden_states`` indices the drafter reads, as its config names them
    (``eagle_aux_hidden_state_layer_ids``); None: EAGLE's default for the bound target."""
    fc_bias: bool = False
    own_embedding: bool = False
    """The checkpoint ships ``embed_tokens.weight`` (used instead of the target's)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EagleError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim % 2:
            raise EagleError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise EagleError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise EagleError(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        if FUSED_LAYERS * self.target_hidden_size == self.hidden_size:
            raise EagleError(f"hidden_size {self.hidden_size} equals {FUSED_LAYERS} x target_hidden_size: fused "
                             "target features and the drafter's own would have the same width")
        if self.rope_linear_factor <= 0:
            raise EagleError(f"a linear RoPE scaling factor must be positive, got {self.rope_linear_factor}")
        if self.feature_layers is not None:
            layers = self.feature_layers
            if (len(layers) != FUSED_LAYERS or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                    for i in layers)):
                raise EagleError(f"an EAGLE-3 drafter reads {FUSED_LAYERS} target layers (non-negative "
                                 f"hidden_states indices), the config names {list(layers)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's layers of an ``num_layers``-layer target: the inputs of layers 2, L // 2 and
    L - 3 (transformers' ``hidden_states`` indices, 0 being the embedding output)."""
    layers = (2, num_layers // 2, num_layers - 3)
    if len(set(layers)) != FUSED_LAYERS or layers[-1] <= layers[1]:
        raise EagleError(f"EAGLE-3's default layers (2, L // 2, L - 3) need a target of at least 7 layers, this one "
                         f"has {num_layers}; name them in the drafter's config.json (eagle_aux_hidden_state_layer_ids)")
    return layers


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        two_e = 2 * c.hidden_size
        self.q_proj = nn.Linear(two_e, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(two_e, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(two_e, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Drafter(DrafterCache, nn.Module):
    """An EAGLE-3 drafter (see the module docstring), run on the target's fused layer features."""

    reads_layers = True
    """`step` reads target hidden states of intermediate layers (`feature_layers`), not the last one."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(FUSED_LAYERS * c.target_hidden_size, c.hidden_size, bias=c.fc_bias)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if c.own_embedding:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self.embed_tokens.weight.requires_grad_(False)
        else:
            self.embed_tokens = None
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.register_buffer("shortlist", None, persistent=False)  # target ids of the draft tokens (`map_vocab`)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self._embed: Tensor | None = None  # the target's input embedding [V, E] (bound, not ours)
        self._layers: tuple[int, ...] | None = None  # the target hidden states `step` reads (bound)
        self._cache = None  # KVCache of one sequence (`reset`)

    # ------------------------------------------------------------------ vocabulary and binding
    def map_vocab(self) -> None:
        """Set ``shortlist`` from ``d2t`` (draft token k is target token k + d2t[k]); None when
        the draft tokens are the target's whole vocabulary in order."""
        ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        identity = ids.numel() == self.config.vocab_size and bool((self.d2t == 0).all())
        self.shortlist = None if identity else ids

    def load_state_dict(self, *args, **kwargs):
        out = super().load_state_dict(*args, **kwargs)
        self.map_vocab()
        return out

    def bind(self, model: nn.Module) -> Eagle3Drafter:
        """Read ``model``'s input embedding (unless the checkpoint has its own) and fix the
        target layers the drafter reads (named by its config, else EAGLE's default for ``model``)."""
        c = self.config
        cfg = getattr(model, "config", None)
        layers_total = getattr(cfg, "num_hidden_layers", None)
        hidden = getattr(cfg, "hidden_size", None)
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        weight = getattr(embed, "weight", None)
        if not isinstance(weight, Tensor) or not isinstance(layers_total, int) or not isinstance(hidden, int):
            raise EagleError(f"an EAGLE-3 drafter needs a transformers causal LM with an input embedding, "
                             f"num_hidden_layers and hidden_size; got {type(model).__name__}")
        if weight.shape[0] != c.vocab_size:
            raise EagleError(f"the drafter's vocabulary ({c.vocab_size} tokens, t2d) differs from the target's "
                             f"({weight.shape[0]} tokens)")
        if hidden != c.target_hidden_size:
            raise EagleError(f"the drafter fuses target hidden states of width {c.target_hidden_size} "
                             f"(fc reads {FUSED_LAYERS * c.target_hidden_size}); the target's are {hidden} wide")
        layers = c.feature_layers if c.feature_layers is not None else default_feature_layers(layers_total)
        if max(layers) >= layers_total:
            raise EagleError(f"the drafter reads the target's hidden_states {list(layers)}; a {layers_total}-layer "
                             f"target has the inputs of layers 0 .. {layers_total - 1}")
        if self.embed_tokens is None:
            if tuple(weight.shape) != (c.vocab_size, c.hidden_size):
                raise EagleError(f"the drafter embeds tokens with the target's [{c.vocab_size}, {c.hidden_size}] "
                                 f"embedding, the target's is {tuple(weight.shape)}; such a drafter needs its own "
                                 "embed_tokens.weight in the checkpoint")
            self._embed = weight.detach()
        self._layers = tuple(layers)
        return self

    @property
    def bound(self) -> bool:
        return self._layers is not None

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The target's ``hidden_states`` indices `step` reads, side by side (None until `bind`)."""
        return self._layers

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def _apply(self, fn, recurse=True):  # .to() / .float(): a cache of the old dtype is dropped
        out = super()._apply(fn, recurse)
        self._cache = None
        return out

    # ------------------------------------------------------------------ compute
    def embed(self, tokens: Tensor) -> Tensor:  # [...] long (target ids) -> [..., E]
        dtype = self.fc.weight.dtype
        if self.embed_tokens is not None:
            return self.embed_tokens(tokens.to(self.embed_tokens.weight.device)).to(dtype)
        if self._embed is None:
            raise EagleError("the drafter reads the target's embedding: bind(target) it first")
        return F.embedding(tokens.to(self._embed.device), self._embed).to(dtype)

    def logits(self, features: Tensor) -> Tensor:
        """Logits of predicted features [..., E] over the draft vocabulary [..., F]."""
        return self.lm_head(self.norm(features.to(self.lm_head.weight.dtype)))

    def step(self, tokens: Tensor, features: Tensor, cache=None, *, positions: Tensor | None = None,
             mask: Tensor | None = None) -> Tensor:
        """Append entries: tokens [T] long (target ids), features [T, 3E_t] (the target's fused
        layers) or [T, E] (the drafter's own predictions) -> predicted features [T, E].

        ``cache``: a `new_cache` to append to instead of the drafter's own; ``positions`` [T] and
        ``mask`` [T, L + T]: as `EagleDrafter.step` takes them (a draft tree's depth)."""
        c, layer = self.config, self.midlayer
        cache = self._cache if cache is None else cache
        t = tokens.shape[0]
        positions, mask = self._layout(cache, t, positions, mask, self.fc.weight.device)
        width = features.shape[-1]
        h = features.to(self.fc.weight.dtype)
        if width == self.fc.in_features:
            h = self.fc(h)
        elif width != c.hidden_size:
            raise EagleError(f"features of width {width}: the drafter reads the target's {FUSED_LAYERS} fused layers "
                             f"({self.fc.in_features}) or its own predictions ({c.hidden_size})")
        x = torch.cat([layer.input_layernorm(self.embed(tokens)), layer.hidden_norm(h)], dim=-1)[None]  # [1, T, 2E]
        attn = layer.self_attn
        q = attn.q_proj(x).view(1, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        freqs = (positions.to(torch.float32) / c.rope_linear_factor)[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, vals = cache.write(0, torch.stack([k, v]))  # [1, Hkv, L + T, D] each
        cache.advance(t)
        groups = c.num_attention_heads // c.num_key_value_heads
        if groups > 1:
            keys, vals = keys.repeat_interleave(groups, 1), vals.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)  # [1, H, T, D]
        u = h + attn.o_proj(out.transpose(1, 2).reshape(t, -1))
        return u + layer.mlp(layer.post_attention_layernorm(u))
