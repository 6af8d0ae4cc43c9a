"""The EAGLE drafter module: one decoder layer over the target's features (see `specops.spec.eagle`).

Parameter names follow EAGLE's checkpoints (``fc``, ``layers.0.self_attn.q_proj``, ...), so
`specops.models.eagle_io` maps a published EAGLE-1 state dict onto it one to one.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class EagleError(ValueError):
    """A drafter that does not fit its target, or a bad drafter input."""


@dataclass(frozen=True)
class EagleConfig:
    """Sizes of an EAGLE drafter (the target's, for a drafter made by `EagleDrafter.for_target`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    fc_bias: bool = True
    """``fc`` has a bias (EAGLE-1's default)."""
    input_layernorm: bool = False
    """An RMSNorm on ``fc``'s output before attention (EAGLE-1's first layer has none)."""
    shortlist_size: int = 0
    """0: draft over the whole vocabulary; F > 0: over the F token ids of the ``shortlist`` buffer."""
    base_model: str = ""
    base_model_hash: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EagleError(f"EagleConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim % 2:
            raise EagleError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise EagleError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if not isinstance(self.shortlist_size, int) or not 0 <= self.shortlist_size <= self.vocab_size:
            raise EagleError(f"shortlist_size must be in 0..vocab_size ({self.vocab_size}), got {self.shortlist_size!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def rope_theta_of(config: Any) -> float:
    """A transformers config's RoPE base (``rope_parameters`` in transformers 5, ``rope_theta`` before)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("rope_theta"), (int, float)):
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if isinstance(theta, (int, float)) else 10000.0


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., E]
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        if c.input_layernorm:
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [B, H, T, D]; cos/sin [T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DrafterCache:
    """The one-sequence KV cache of a one-layer drafter (EAGLE-1's `EagleDrafter`, EAGLE-3's
    `Eagle3Drafter`): its ``config`` gives the sizes, its ``fc`` the dtype and device, and it keeps
    its own cache in ``_cache``."""

    def new_cache(self, max_len: int | None = None):
        """An empty KV cache of one sequence for ``step(..., cache=)``, of ``max_len`` entries
        (default and most: `max_context`). Decoding keeps one per sequence in its
        `specops.spec.eagle.EagleCursor` (the library's requests and the serving engine's
        sequences alike); the drafter also keeps one of its own (`reset`), which `step` uses by
        default."""
        from specops.models.kv_cache import KVCache

        c = self.config
        size = c.max_position_embeddings if max_len is None else min(max_len, c.max_position_embeddings)
        return KVCache(layers=1, kv_heads=c.num_key_value_heads, head_dim=c.head_dim, max_len=max(size, 1),
                       dtype=self.fc.weight.dtype, device=self.fc.weight.device)

    def reset(self) -> None:
        """Empty the drafter's own KV cache (one sequence): a new one where the last was made in
        inference mode and this runs outside it (such a tensor cannot be written there)."""
        if self._cache is None or (self._cache.data.is_inference() and not torch.is_inference_mode_enabled()):
            self._cache = self.new_cache()
        self._cache.reset(1)

    @property
    def cache(self):
        """The drafter's own KV cache (`reset` makes it), which `step` appends to by default."""
        return self._cache

    @property
    def cache_len(self) -> int:
        return 0 if self._cache is None else self._cache.length

    def truncate(self, length: int) -> None:
        self._cache.truncate(length)

    def _layout(self, cache, t: int, positions: Tensor | None, mask: Tensor | None,
                device: torch.device) -> tuple[Tensor, Tensor | None]:
        """`step`'s RoPE positions [T] and attention mask [T, L + T] (None: one entry, which sees
        everything) for ``t`` entries appended to ``cache``; by default the next slots, causal."""
        start = cache.length
        if start + t > cache.max_len:
            raise EagleError(f"drafter context of {cache.max_len} positions exceeded ({start} + {t})")
        if positions is None:
            positions = torch.arange(start, start + t, device=device)
        elif tuple(positions.shape) != (t,):
            raise EagleError(f"positions must be [T] = [{t}], got {tuple(positions.shape)}")
        if mask is None:
            return positions, (torch.ones(t, start + t, dtype=torch.bool, device=device).tril(start) if t > 1 else None)
        if tuple(mask.shape) != (t, start + t) or mask.dtype != torch.bool:
            raise EagleError(f"mask must be a [T, L + T] = [{t}, {start + t}] bool tensor, got "
                             f"{tuple(mask.shape)} {mask.dtype}")
        return positions, mask.to(device)


class EagleDrafter(DrafterCache, nn.Module):
    """The drafter (see the module docstring): parameters ``fc`` and ``layers.0.*`` as EAGLE names them."""

    reads_layers = False
    """`step` reads the target's last hidden state (EAGLE-3 drafters read intermediate layers)."""
    feature_layers = None
    """No intermediate target layers: `TargetVerifier` keeps the last hidden state (``keep_features=True``)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        e = config.hidden_size
        self.fc = nn.Linear(2 * e, e, bias=config.fc_bias)
        self.layers = nn.ModuleList([_Layer(config)])
        if config.shortlist_size:
            self.register_buffer("shortlist", torch.arange(config.shortlist_size, dtype=torch.long))
        else:
            self.shortlist = None
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self._embed: Tensor | None = None  # the target's input embedding [V, E] (bound, not ours)
        self._lm_weight: Tensor | None = None  # the target's LM head [V, E] (or its shortlisted rows [F, E])
        self._lm_bias: Tensor | None = None
        self._lm_full: tuple[Tensor, Tensor | None] | None = None  # the whole LM head (training)
        self._cache = None  # KVCache of one sequence (`reset`)
        self._packed: _PackedDrafter | None = None  # inference copies in the C kernels' layout (`packed`)
        self._kernel_weights = "bf16"

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(cls, model: nn.Module, *, shortlist: Tensor | list[int] | None = None,
                   input_layernorm: bool = True, seed: int | None = None) -> EagleDrafter:
        """A randomly initialised drafter with ``model``'s sizes, bound to it."""
        from specops.models.medusa_heads import model_fingerprint

        cfg = model.config
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        tokens = None if shortlist is None else torch.as_tensor(shortlist, dtype=torch.long).flatten()
        config = EagleConfig(
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=head_dim, vocab_size=cfg.vocab_size,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), rope_theta=rope_theta_of(cfg),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048) or 2048),
            input_layernorm=input_layernorm, shortlist_size=0 if tokens is None else tokens.numel(),
            base_model=str(getattr(cfg, "_name_or_path", "") or type(model).__name__),
            base_model_hash=model_fingerprint(model),
        )
        if seed is not None:
            torch.manual_seed(seed)
        drafter = cls(config)
        std = float(getattr(cfg, "initializer_range", 0.02))
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std)
        if tokens is not None:
            drafter.set_shortlist(tokens)
        return drafter.bind(model)

    def bind(self, model: nn.Module) -> EagleDrafter:
        """Use ``model``'s input embedding and LM head (frozen; never saved with the drafter)."""
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        c = self.config
        for name, module in (("input embedding", embed), ("LM head", head)):
            weight = getattr(module, "weight", None)
            if not isinstance(weight, Tensor) or tuple(weight.shape) != (c.vocab_size, c.hidden_size):
                shape = None if not isinstance(weight, Tensor) else tuple(weight.shape)
                raise EagleError(f"the drafter needs a [{c.vocab_size}, {c.hidden_size}] {name}; "
                                 f"{type(model).__name__} has {shape}")
        if c.base_model_hash:
            from specops.models.medusa_heads import model_fingerprint

            if model_fingerprint(model) != c.base_model_hash:
                log.warning("EAGLE drafter was trained for %r, not this model: output stays exact, "
                            "acceptance may be poor", c.base_model)
        self._embed = embed.weight.detach()
        bias = getattr(head, "bias", None)
        self._lm_full = (head.weight.detach(), None if bias is None else bias.detach())
        self._rebind_head()
        return self

    def _rebind_head(self) -> None:
        if self._lm_full is None:
            return
        weight, bias = self._lm_full
        if self.shortlist is not None:
            rows = self.shortlist.to(weight.device)
            weight, bias = weight[rows].contiguous(), None if bias is None else bias[rows].contiguous()
        dtype = self.fc.weight.dtype
        self._lm_weight = weight.to(dtype)
        self._lm_bias = None if bias is None else bias.to(dtype)
        self._packed = None

    def set_shortlist(self, tokens: Tensor | list[int] | None) -> None:
        """Draft only over ``tokens`` (distinct ids); None: the whole vocabulary."""
        v = self.config.vocab_size
        self._buffers.pop("shortlist", None)
        self.__dict__.pop("shortlist", None)
        if tokens is None:
            self.shortlist = None
            self.config = dataclasses.replace(self.config, shortlist_size=0)
        else:
            tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
            if (tokens.numel() < 1 or int(tokens.min()) < 0 or int(tokens.max()) >= v
                    or tokens.unique().numel() != tokens.numel()):
                raise EagleError(f"a shortlist must be distinct token ids in 0..{v - 1}")
            self.register_buffer("shortlist", tokens.to(self.fc.weight.device))
            self.config = dataclasses.replace(self.config, shortlist_size=tokens.numel())
        self._rebind_head()

    @property
    def bound(self) -> bool:
        return self._embed is not None

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def _apply(self, fn, recurse=True):  # .to() / .float(): the bound head follows the drafter's dtype
        out = super()._apply(fn, recurse)
        self._cache = None
        self._rebind_head()
        return out

    def train(self, mode: bool = True) -> EagleDrafter:
        self._packed = None  # training changes the weights the packed copies were made from
        return super().train(mode)

    def load_state_dict(self, *args, **kwargs):
        self._packed = None
        return super().load_state_dict(*args, **kwargs)

    @property
    def kernel_weights(self) -> str:
        """The dtype of the packed copies' matrices (`packed`): "bf16" (the default; fp32 where the C
        kernel reads no bfloat16) or "fp32"."""
        return self._kernel_weights

    @kernel_weights.setter
    def kernel_weights(self, value: str) -> None:
        if value not in ("fp32", "bf16"):
            raise EagleError(f"kernel_weights must be 'fp32' or 'bf16', got {value!r}")
        self._kernel_weights = value
        self._packed = None

    def packed(self) -> _PackedDrafter | None:
        """Inference copies of the drafter's matrices and the bound (shortlisted) LM head in the C
        kernels' layout (`specops.models.packed_linear.PackedLinear`), made on first use; None where
        they do not apply (training, autograd on, not fp32 on a CPU, no C kernel). A drafted token
        is a handful of one-row products, which the C kernel streams at about twice MKL's speed at
        one row; the LM head over the shortlist was half the drafter's time through `F.linear`.
        With `kernel_weights` "bf16" (where the kernel reads bfloat16 weights) the copies hold half
        the bytes: on SmolLM2-135M's drafter a γ 4 chain took 2.9 ms instead of 5.4. Its proposals
        may differ from the fp32 module's at near ties; the verification keeps the output exact."""
        if self.training or torch.is_grad_enabled() or self._lm_weight is None:
            return None
        if self._packed is not None and not self._packed.current(self):
            self._packed = None  # a weight changed in place since: copy again
        if self._packed is None:
            from specops.kernels import cpu_linear

            w = self.fc.weight
            if w.device.type != "cpu" or w.dtype != torch.float32 or not cpu_linear.available():
                return None
            self._packed = _PackedDrafter(self, bf16=self._kernel_weights == "bf16")
        return self._packed

    # ------------------------------------------------------------------ compute
    def embed(self, tokens: Tensor) -> Tensor:  # [...] long -> [..., E]
        if self._embed is None:
            raise EagleError("the drafter reads the target's embedding and LM head: bind(target) it first")
        return F.embedding(tokens.to(self._embed.device), self._embed).to(self.fc.weight.dtype)

    def logits(self, features: Tensor, *, full: bool = False) -> Tensor:
        """LM-head logits of predicted features [..., E] -> [..., F] over the shortlist (or [..., V]
        with ``full`` / without a shortlist)."""
        if self._lm_weight is None:
            raise EagleError("the drafter reads the target's embedding and LM head: bind(target) it first")
        packed = None if full else self.packed()
        if packed is not None and features.dim() <= 2:
            flat = features.to(self._lm_weight.dtype).reshape(-1, features.shape[-1])
            return packed.head(flat).reshape(*features.shape[:-1], -1)
        if full and self.shortlist is not None:
            weight, bias = self._lm_full
            return F.linear(features.to(weight.dtype), weight, bias)
        return F.linear(features.to(self._lm_weight.dtype), self._lm_weight, self._lm_bias)

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # [T] -> cos, sin [T, D]
        freqs = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        dtype = self.fc.weight.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """fc output x [B, T, E] -> q [B, H, T, D], k and v [B, Hkv, T, D] (RoPE applied)."""
        c, layer = self.config, self.layers[0]
        b, t, _ = x.shape
        h = layer.input_layernorm(x) if c.input_layernorm else x
        attn = layer.self_attn
        q = attn.q_proj(h).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self._rope(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _out(self, x: Tensor, attn: Tensor) -> Tensor:
        """The rest of the layer: x [B, T, E] (fc output), attention output [B, H, T, D] -> [B, T, E]."""
        layer = self.layers[0]
        b, _, t, _ = attn.shape
        x = x + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _groups(self) -> int:
        return self.config.num_attention_heads // self.config.num_key_value_heads

    def forward(self, tokens: Tensor, features: Tensor, steps: int = 1) -> list[Tensor]:
        """Training forward over whole sequences, no cache: tokens [B, T] (entry i's token x_{i+1}),
        features [B, T, E] (f_i) -> one [B, T, E] prediction of f_{i+1} per unrolled step.

        Step 0 reads the real features. Step s >= 1 reads at entry i the prediction of step
        s - 1 at entry i - 1, and attends to the real entries j <= i - s and to the chain of
        entries that led to it (step r at entry i - s + r): exactly what entry i sees when
        it is the s-th drafted token of a chain (training-time test, as EAGLE-3 trains).
        Rows i < s of step s have no such chain; their values are not meaningful."""
        b, t = tokens.shape
        groups, scale = self._groups(), self.config.head_dim ** -0.5
        positions = torch.arange(t, device=tokens.device)
        emb = self.embed(tokens)  # [B, T, E]
        outs: list[Tensor] = []
        keys: list[Tensor] = []
        values: list[Tensor] = []
        feats = features.to(emb.dtype)
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        for s in range(steps):
            if s:
                feats = torch.cat([outs[-1][:, :1], outs[-1][:, :-1]], dim=1)  # entry i reads step s-1's entry i-1
            x = self.fc(torch.cat([emb, feats], dim=-1))
            q, k, v = self._qkv(x, positions)
            keys.append(k.repeat_interleave(groups, 1))
            values.append(v.repeat_interleave(groups, 1))
            scores = (q @ keys[0].transpose(-1, -2)) * scale  # [B, H, T, T] against the real entries
            allowed = causal if s == 0 else torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril(-s)
            scores = scores.masked_fill(~allowed, float("-inf"))
            chain = []  # step r's key at entry i - s + r, r = 1..s
            for r in range(1, s + 1):
                shifted = _shift(keys[r], s - r)
                chain.append((q * shifted).sum(-1, keepdim=True) * scale)  # [B, H, T, 1]
            weights = torch.softmax(torch.cat([scores, *chain], dim=-1).float(), dim=-1).to(q.dtype)
            attn = weights[..., :t] @ values[0]
            for r in range(1, s + 1):
                attn = attn + weights[..., t + r - 1 : t + r] * _shift(values[r], s - r)
            outs.append(self._out(x, attn))
        return outs

    def step(self, tokens: Tensor, features: Tensor, cache=None, *, positions: Tensor | None = None,
             mask: Tensor | None = None) -> Tensor:
        """Append entries to the cache: tokens [T] long, features [T, E] -> predicted next features [T, E].

        ``cache``: a `new_cache` to append to instead of the drafter's own. ``positions`` [T] long:
        the entries' RoPE positions (default: their slots, L .. L + T - 1); ``mask`` [T, L + T]
        bool: entry i attends to slot j where True (default: causal). A draft tree's nodes of
        one depth share a position and see the real entries and their own ancestors
        (`specops.spec.eagle_tree`)."""
        cache = self._cache if cache is None else cache
        t = tokens.shape[0]
        positions, mask = self._layout(cache, t, positions, mask, self.fc.weight.device)
        packed = self.packed()
        entries = torch.cat([self.embed(tokens), features.to(self.fc.weight.dtype)], dim=-1)  # [T, 2E]
        if packed is not None:
            x = packed.fc(entries)[None]  # [1, T, E]
            q, k, v = packed.qkv(self, x, positions)
        else:
            x = self.fc(entries)[None]  # [1, T, E]
            q, k, v = self._qkv(x, positions)
        keys, vals = cache.write(0, torch.stack([k, v]))  # [1, Hkv, L + T, D] each
        cache.advance(t)
        groups = self._groups()
        if groups > 1:
            keys, vals = keys.repeat_interleave(groups, 1), vals.repeat_interleave(groups, 1)
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        if packed is not None:
            return packed.out(x[0], attn[0].transpose(0, 1).reshape(t, -1))
        return self._out(x, attn)[0]


def _weight_slots(d: EagleDrafter) -> list[tuple[object, str]]:
    """(owner, attribute) of every weight the packed copies are made from."""
    slots: list[tuple[object, str]] = [(module, name) for module in d.modules() for name, p in
                                       module.named_parameters(recurse=False) if p is not None]
    return slots + [(d, "_lm_weight")]


class _PackedDrafter:
    """`EagleDrafter.packed`: its matrices as `PackedLinear`s (q, k, v side by side, gate and up
    side by side), the post-attention norm fused into the MLP's first product, the residual adds
    into the products that end each block; the same arithmetic as the module's forward."""

    def __init__(self, d: EagleDrafter, bf16: bool = False) -> None:
        from specops.models.packed_linear import PackedLinear

        layer = d.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        kw = {"onednn": False, "kernel_bf16": bf16}
        self.fc = PackedLinear(d.fc.weight, d.fc.bias, **kw)
        self.in_norm = layer.input_layernorm if d.config.input_layernorm else None
        self._qkv = PackedLinear.fuse([attn.q_proj, attn.k_proj, attn.v_proj], **kw)
        self.o_proj = PackedLinear(attn.o_proj.weight, None, **kw)
        self.post_norm = layer.post_attention_layernorm
        self.gate_up = PackedLinear.fuse([mlp.gate_proj, mlp.up_proj], **kw)
        self.down = PackedLinear(mlp.down_proj.weight, None, **kw)
        self.head = PackedLinear(d._lm_weight, d._lm_bias, **kw)
        # each weight's identity and in-place version, read straight from its owner (no module walk per call)
        self.slots = _weight_slots(d)
        self.stamp = [(getattr(owner, name), getattr(owner, name)._version) for owner, name in self.slots]
        c = d.config
        self.sizes = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                      c.num_key_value_heads * c.head_dim)

    def current(self, d: EagleDrafter) -> bool:
        """Whether every weight is the one these copies were made from, unchanged in place."""
        for (owner, name), (tensor, version) in zip(self.slots, self.stamp):
            now = getattr(owner, name)
            if now is not tensor or now._version != version:
                return False
        return True

    def qkv(self, d: EagleDrafter, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`EagleDrafter._qkv` through the fused product: x [1, T, E] -> q [1, H, T, D], k, v [1, Hkv, T, D]."""
        c = d.config
        t = x.shape[1]
        h = x[0]
        if self.in_norm is not None:
            fused = self._qkv.normed(h, self.in_norm.weight, self.in_norm.eps)
        else:
            fused = self._qkv(h)
        q, k, v = fused.split(self.sizes, dim=-1)
        q = q.reshape(1, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = k.reshape(1, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(1, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = d._rope(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def out(self, x: Tensor, attn: Tensor) -> Tensor:
        """`EagleDrafter._out`: x [T, E] (fc output), attention [T, H*D] -> [T, E]."""
        x = self.o_proj.add_to(x.contiguous(), attn.contiguous())
        gate_up = self.gate_up.normed(x, self.post_norm.weight, self.post_norm.eps)
        return self.down.swiglu_add_to(x, gate_up)


def _shift(x: Tensor, by: int) -> Tensor:
    """x [B, H, T, D] moved ``by`` entries later along T (the first ``by`` rows repeat row 0)."""
    if by == 0:
        return x
    return torch.cat([x[:, :, :1].expand(-1, -1, by, -1), x[:, :, :-by]], dim=2)


