"""The fast path: a compact forward for Llama-family models (Llama, Mistral, Qwen2).

At batch 1 a small model's decoding step is dominated by per-op overhead, not FLOPs:
transformers' forward issues ~1,300 small ops per step and its `DynamicCache`
concatenates every layer's keys and values each step. This runner reads the weights of a
loaded transformers model (no copy of its modelling code) and runs them with ~15 ops per
layer:

- q/k/v are one matmul (fused [Wq; Wk; Wv], with Qwen2's q/k/v bias) and gate/up another;
  the fused tensors become the storage of the model's own parameters, so memory is not
  doubled;
- rotary embeddings use precomputed cos/sin tables and a signed permutation matmul for
  `rotate_half`, applied to the q, k (and, with cos = 1 / sin = 0, the v) heads in one go;
- keys/values go into a preallocated `KVCache`; rollback moves a length pointer and a tree
  path is compacted with one gather;
- attention is `F.scaled_dot_product_attention` (grouped-query attention natively): no mask
  for one new position, `is_causal` only for a prefill on an empty cache, an explicit
  [T, L + T] bool mask otherwise (causal, or the tree mask after the prefix).

Logits are returned in float32 and equal transformers' forward up to float rounding.
Sliding-window attention is rejected when the window is shorter than the context
(`load_runner` then falls back to `HFRunner`), as are RoPE variants whose frequencies
depend on the sequence length (dynamic NTK, LongRoPE).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from specops.decoder.kv_cache import KVCache
from specops.decoder.runner import (
    FAST_MODEL_TYPES,
    RunnerOutput,
    UnsupportedModelError,
    check_batch_size,
    check_compact,
    check_forward_args,
    check_truncate,
    model_context_limit,
    sliding_window,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 4096  # preallocated positions when neither the caller nor a smaller model limit says otherwise
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def tree_attention(
    q: Tensor,  # [B, Hq, T, D]
    k: Tensor,  # [B, Hkv, L + T, D]
    v: Tensor,  # [B, Hkv, L + T, D]
    mask: Tensor,  # [T, L + T] bool: query i may see key j
    scale: float,
) -> Tensor:  # [B, Hq, T, D]
    """Attention of T tree nodes over the cached prefix and the tree (the one call site to
    switch to the Triton kernel `specops.kernels.tree_attention`)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class _Layer:
    """One decoder layer's weights, fused for the compact forward."""

    __slots__ = ("ln1", "wqkv", "bqkv", "wo_t", "bo", "ln2", "wgu", "bgu", "wd_t", "bd", "act")

    def __init__(self, layer, share_weights: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1 = layer.input_layernorm.weight.detach()  # [E]
        self.ln2 = layer.post_attention_layernorm.weight.detach()  # [E]
        self.wqkv, self.bqkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], share_weights)  # [(Hq+2Hkv)*D, E]
        self.wgu, self.bgu = _fuse([mlp.gate_proj, mlp.up_proj], share_weights)  # [2I, E]
        self.wo_t = attn.o_proj.weight.detach().t()  # [Hq*D, E]
        self.bo = None if attn.o_proj.bias is None else attn.o_proj.bias.detach()
        self.wd_t = mlp.down_proj.weight.detach().t()  # [I, E]
        self.bd = None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach()
        self.act = F.silu if mlp.act_fn.__class__.__name__ == "SiLUActivation" else mlp.act_fn


def _fuse(linears, share_weights: bool) -> tuple[Tensor, Tensor | None]:
    """Concatenate nn.Linear weights along the output dim; optionally make the fused tensor
    the storage of the original parameters so the model's memory is not doubled."""
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears], dim=0)  # [sum(out), E]
        has_bias = any(m.bias is not None for m in linears)
        bias = None
        if has_bias:
            parts = [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in linears]
            bias = torch.cat(parts)  # [sum(out)]
        if share_weights:
            offset = 0
            for m in linears:
                rows = m.weight.shape[0]
                m.weight.data = weight[offset : offset + rows]
                if m.bias is not None:
                    m.bias.data = bias[offset : offset + rows]
                offset += rows
    return weight, bias


def _rotate_half_matrix(head_dim: int, dtype: torch.dtype, device: torch.device) -> Tensor:  # [D, D]
    """P with x @ P == rotate_half(x) == cat(-x[D/2:], x[:D/2]) (exact: entries are 0 and ±1)."""
    half = head_dim // 2
    p = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    idx = torch.arange(half, device=device)
    p[idx + half, idx] = -1.0
    p[idx, idx + half] = 1.0
    return p


class FastLlamaRunner:
    """Compact Llama/Mistral/Qwen2 forward with a preallocated KV cache (`ModelRunner`)."""

    def __init__(self, model, *, max_context: int | None = None, share_weights: bool = True) -> None:
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in FAST_MODEL_TYPES:
            raise UnsupportedModelError(
                f"FastLlamaRunner runs {', '.join(FAST_MODEL_TYPES)} models, not {model_type!r}"
            )
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(f"{type(model).__name__} lacks the .model.layers / .lm_head layout")
        self.max_context = self._context(config, max_context)
        rotary = base.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(f"RoPE type {rope_type!r} depends on the sequence length; use HFRunner")

        self.model = model.eval()
        self.config = config
        emb = base.embed_tokens.weight.detach()  # [V, E]
        self.device = emb.device
        self.dtype = emb.dtype
        self.vocab_size = int(model.lm_head.weight.shape[0])
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(f"{self.n_heads} query heads are not a multiple of {self.n_kv_heads} kv heads")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        self.hidden_size = emb.shape[1]
        self.scale = self.head_dim**-0.5
        self.eps = float(config.rms_norm_eps)

        self.embed = emb
        self.layers = [_Layer(layer, share_weights) for layer in base.layers[: config.num_hidden_layers]]
        self.norm = base.norm.weight.detach()  # [E]
        self.lm_head = model.lm_head.weight.detach()  # [V, E]
        self.lm_bias = None if getattr(model.lm_head, "bias", None) is None else model.lm_head.bias.detach()

        # rotary tables for every position: [S, D] each, in the model dtype (as transformers casts them)
        inv_freq = rotary.original_inv_freq.detach().to(device=self.device, dtype=torch.float32)  # [D/2]
        positions = torch.arange(self.max_context, device=self.device, dtype=torch.float32)  # [S]
        freqs = positions[:, None] * inv_freq[None, :]  # [S, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [S, D]
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._cos = (angles.cos() * scaling).to(self.dtype)  # [S, D]
        self._sin = (angles.sin() * scaling).to(self.dtype)  # [S, D]
        self._rot = _rotate_half_matrix(self.head_dim, self.dtype, self.device)  # [D, D]
        # v heads pass through the rotary step unchanged (cos 1, sin 0: exact)
        self._v_ones = torch.ones(1, self.n_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        self._v_zeros = torch.zeros(1, self.n_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        self._positions = torch.arange(self.max_context, device=self.device)  # [S]

        self.cache = KVCache(
            layers=len(self.layers),
            kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            max_len=self.max_context,
            dtype=self.dtype,
            device=self.device,
        )

    @staticmethod
    def _context(config, max_context: int | None) -> int:
        limit = model_context_limit(config)
        window = sliding_window(config)
        if max_context is None:
            candidates = [c for c in (limit, window, DEFAULT_MAX_CONTEXT) if c is not None]
            return min(candidates)
        if not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"max_context must be a positive int, got {max_context!r}")
        if limit is not None and max_context > limit:
            raise ValueError(f"max_context {max_context} exceeds the model's {limit} positions")
        if window is not None and max_context > window:
            raise UnsupportedModelError(
                f"sliding-window attention ({window} positions) is not supported beyond the window "
                f"(max_context {max_context}); use max_context <= {window} or HFRunner"
            )
        return max_context

    def __repr__(self) -> str:
        return (
            f"FastLlamaRunner({self.config.model_type}, layers={len(self.layers)}, "
            f"max_context={self.max_context}, cache_len={self.cache.length})"
        )

    @property
    def cache_len(self) -> int:
        return self.cache.length

    def reset(self, batch_size: int = 1) -> None:
        self.cache.reset(check_batch_size(batch_size))

    def truncate(self, length: int) -> None:
        self.cache.truncate(check_truncate(length, self.cache.length))

    def compact(self, start: int, keep: Tensor) -> None:  # keep: [n] long offsets from start
        index = check_compact(start, keep, self.cache.length, self.device)  # [n]
        with torch.inference_mode():
            self.cache.compact(start, index)

    def forward(
        self,
        input_ids: Tensor,  # [B, T] long
        *,
        position_ids: Tensor | None = None,  # [B, T] long
        tree_mask: Tensor | None = None,  # [T, T] bool
        need_hidden: bool = False,
    ) -> RunnerOutput:
        args = check_forward_args(
            input_ids,
            position_ids,
            tree_mask,
            batch_size=self.cache.batch,
            cache_len=self.cache.length,
            max_context=self.max_context,
            device=self.device,
        )
        with torch.inference_mode():
            hidden = self._forward(input_ids.to(self.device), args.position_ids, args.tree_mask)  # [B, T, E]
            logits = F.linear(hidden, self.lm_head, self.lm_bias)  # [B, T, V]
            if logits.dtype != torch.float32:
                logits = logits.float()
        return RunnerOutput(logits=logits, hidden=hidden if need_hidden else None)

    def _rotary(self, b: int, t: int, position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """cos/sin for the q, k and v heads of this forward, each [B or 1, T, Hq + 2Hkv, D]."""
        start = self.cache.length
        if position_ids is None:
            cos = self._cos[start : start + t].unsqueeze(0)  # [1, T, D]
            sin = self._sin[start : start + t].unsqueeze(0)
        else:
            cos = self._cos[position_ids]  # [B, T, D]
            sin = self._sin[position_ids]
        rows = cos.shape[0]
        qk_heads = self.n_heads + self.n_kv_heads
        cos = torch.cat(
            [cos.unsqueeze(2).expand(rows, t, qk_heads, -1), self._v_ones.expand(rows, t, -1, -1)], dim=2
        )  # [B|1, T, Hq+2Hkv, D]
        sin = torch.cat(
            [sin.unsqueeze(2).expand(rows, t, qk_heads, -1), self._v_zeros.expand(rows, t, -1, -1)], dim=2
        )
        return cos, sin

    def _mask(self, t: int, tree_mask: Tensor | None) -> tuple[Tensor | None, bool]:
        """The attention mask [T, L + T] bool (or None) and whether SDPA's is_causal applies."""
        start = self.cache.length
        if tree_mask is None:
            if t == 1:
                return None, False
            if start == 0:
                return None, True  # top-left aligned causal mask is right without a prefix
            keys = self._positions[: start + t]  # [L + T]
            queries = self._positions[start : start + t]  # [T]
            return keys[None, :] <= queries[:, None], False  # [T, L + T]
        mask = torch.ones(t, start + t, dtype=torch.bool, device=self.device)  # [T, L + T]
        mask[:, start:] = tree_mask
        return mask, False

    def _forward(self, input_ids: Tensor, position_ids: Tensor | None, tree_mask: Tensor | None) -> Tensor:
        b, t = input_ids.shape  # [B, T]
        hq, hkv, d, e = self.n_heads, self.n_kv_heads, self.head_dim, self.hidden_size
        cache, eps, scale = self.cache, self.eps, self.scale
        cos, sin = self._rotary(b, t, position_ids)  # [B|1, T, Hq+2Hkv, D]
        mask, causal = self._mask(t, tree_mask)  # [T, L+T] | None
        gqa = hq != hkv
        x = F.embedding(input_ids, self.embed).view(b * t, e)  # [B*T, E]
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, (e,), layer.ln1, eps)  # [B*T, E]
            qkv = F.linear(h, layer.wqkv, layer.bqkv).view(b, t, hq + 2 * hkv, d)  # [B, T, Hq+2Hkv, D]
            qkv = torch.addcmul(qkv * cos, torch.matmul(qkv, self._rot), sin)  # rotary on q, k
            q = qkv[:, :, :hq].transpose(1, 2)  # [B, Hq, T, D]
            kv = qkv[:, :, hq:].view(b, t, 2, hkv, d).permute(2, 0, 3, 1, 4)  # [2, B, Hkv, T, D]
            k, v = cache.write(i, kv)  # [B, Hkv, L+T, D] each
            if tree_mask is not None:
                o = tree_attention(q, k, v, mask, scale)  # [B, Hq, T, D]
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
            o = o.transpose(1, 2).reshape(b * t, hq * d)  # [B*T, Hq*D]
            x = torch.addmm(x, o, layer.wo_t) if layer.bo is None else x + F.linear(o, layer.wo_t.t(), layer.bo)
            h = F.rms_norm(x, (e,), layer.ln2, eps)  # [B*T, E]
            gate, up = F.linear(h, layer.wgu, layer.bgu).chunk(2, dim=-1)  # [B*T, I] each
            act = layer.act(gate) * up  # [B*T, I]
            x = torch.addmm(x, act, layer.wd_t) if layer.bd is None else x + F.linear(act, layer.wd_t.t(), layer.bd)
        cache.advance(t)
        x = F.rms_norm(x, (e,), self.norm, eps)  # [B*T, E]
        return x.view(b, t, e)  # [B, T, E]
