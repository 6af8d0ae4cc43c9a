"""The fast path: a compact forward for Llama-family models (Llama, Mistral, Qwen2).

At batch 1 a small model's decoding step is dominated by per-op overhead, not FLOPs:
transformers' forward issues ~1,300 small ops per step and its `DynamicCache`
concatenates every layer's keys and values each step. This runner reads the weights of a
loaded transformers model (no copy of its modelling code) and runs them with ~15 ops per
layer:

- q/k/v are one matmul (fused [Wq; Wk; Wv], with Qwen2's q/k/v bias) and gate/up another,
  each a `PackedLinear` (weights laid out for the fastest CPU kernel per row count; residual
  adds fused into the matmul). The runner snapshots the weights when it is built: rebuild
  it after changing the model's weights;
- rotary embeddings use precomputed cos/sin tables; `rotate_half` is a roll with the sign
  folded into the sin table, applied to the q and k heads in one go (v heads get cos 1 and
  sin 0, which leaves them exactly unchanged);
- keys/values go into a preallocated `KVCache`; rollback moves a length pointer and a tree
  path is compacted with one gather;
- attention is `F.scaled_dot_product_attention` (grouped-query attention natively) for one
  new position (no mask) and for a prefill on an empty cache (`is_causal`); the few new
  positions of a verification after a prefix (a draft block, a Medusa tree) go through
  `grouped_attention`, three batched matmuls with an additive mask built once per forward
  (causal, or the tree mask after the prefix), or the Triton tree kernel on CUDA.

On fp32 CPU with the C kernels built, a forward of up to C_LAYERS_MAX_T tokens of one
sequence (decoding steps, chain verifications, Medusa trees) skips all of the above: the
layer stack, the final norm and the LM head run in one `cpu_linear.llama_layers` call. So
does a prompt pass of any length (`prompt_forward`, `runner.prompt_forward`), with the LM
head on its last position only, or none.

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

from specops.models.kv_cache import KVCache
from specops.models.packed_linear import PackedLinear, onednn_usable
from specops.models.runner import (
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
from specops.kernels import MAX_TREE_NODES, cpu_linear
from specops.kernels import tree_attention as kernel_tree_attention

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 4096  # preallocated positions when neither the caller nor a smaller model limit says otherwise
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
TREE_ATTENTION_IMPLS = ("auto", "sdpa", "kernel")
GROUPED_ATTENTION_MAX_T = 64  # new positions up to which a forward after a prefix uses `grouped_attention`
C_LAYERS_MAX_T = 16  # new positions up to which one sequence's forward runs the C layer stack
# per-head rotary tables [S, Hq+2Hkv, D] are precomputed up to this size (cos + sin together);
# above it each forward assembles them from the [S, D] tables
ROPE_HEAD_TABLE_BYTES = 32 << 20


def grouped_attention(
    q: Tensor,  # [B, T, Hq, D] (query heads of kv head j are j*G .. j*G + G-1)
    k: Tensor,  # [B, Hkv, L + T, D]
    v: Tensor,  # [B, Hkv, L + T, D]
    bias: Tensor,  # [G*T, L + T] additive mask: 0 where query i may see key j, -inf elsewhere
    scale: float,
) -> Tensor:  # [B*T, Hq*D]
    """Attention of a few new positions as three batched matmuls, one per kv head.

    For the small T of a verification (a draft block, a Medusa tree) SDPA with an explicit
    mask converts the bool mask per call and per layer and took 105 us per layer at T = 5
    against 53 us at T = 1 (bundled target, one thread). Here the G query heads sharing a
    kv head are stacked as G*T rows of one matmul against that head's keys (no repeat of
    k / v), and the mask is an additive bias built once per forward.
    """
    b, t, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    rows = q.permute(0, 2, 1, 3).reshape(b * hkv, (hq // hkv) * t, d)  # [B*Hkv, G*T, D] rows (group, position)
    keys = k.reshape(b * hkv, n, d)  # [B*Hkv, L+T, D] (a view of the cache)
    scores = torch.baddbmm(bias, rows, keys.transpose(1, 2), alpha=scale)  # [B*Hkv, G*T, L+T]
    probs = torch.softmax(scores, dim=-1)  # [B*Hkv, G*T, L+T]
    out = torch.bmm(probs, v.reshape(b * hkv, n, d))  # [B*Hkv, G*T, D]
    return out.view(b, hq, t, d).transpose(1, 2).reshape(b * t, hq * d)


class _Layer:
    """One decoder layer's weights: q/k/v fused into one linear, gate/up into another."""

    __slots__ = ("ln1", "qkv", "o", "ln2", "gate_up", "down", "act", "swiglu")

    def __init__(self, layer, onednn: bool, bf16: bool = False) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1 = layer.input_layernorm.weight.detach()  # [E]
        self.ln2 = layer.post_attention_layernorm.weight.detach()  # [E]
        self.qkv = PackedLinear.fuse([attn.q_proj, attn.k_proj, attn.v_proj], onednn=onednn,
                                     kernel_bf16=bf16)  # E -> (Hq+2Hkv)*D
        self.o = PackedLinear(attn.o_proj.weight, attn.o_proj.bias, onednn=onednn, kernel_bf16=bf16)  # Hq*D -> E
        self.gate_up = PackedLinear.fuse([mlp.gate_proj, mlp.up_proj], onednn=onednn, kernel_bf16=bf16)  # E -> 2I
        self.down = PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias, onednn=onednn, kernel_bf16=bf16)  # I -> E
        # transformers' SiLU module is plain silu; calling the functional form skips a module call
        self.act = F.silu if type(mlp.act_fn).__name__ in ("SiLUActivation", "SiLU") else mlp.act_fn
        self.swiglu = self.act is F.silu  # silu(gate) * up can go into the down projection's kernel call


class FastLlamaRunner:
    """Compact Llama/Mistral/Qwen2 forward with a preallocated KV cache (`ModelRunner`)."""

    def __init__(
        self, model, *, max_context: int | None = None, tree_attention: str = "auto", onednn: bool | None = None,
        kernel_weights: str = "fp32",
    ) -> None:
        """`tree_attention`: "auto" (Triton kernel on CUDA, `grouped_attention` elsewhere), "sdpa" or "kernel".
        `onednn`: run multi-row matmuls with oneDNN prepacked weights (None: when usable here).
        `kernel_weights`: "fp32", or "bf16" for the C kernels' copies of an fp32 model's
        matrices (half the bytes streamed per token, logits to bf16 weight precision: for
        a draft model, whose logits only propose; its prompt pass reads them too on the C stack)."""
        if kernel_weights not in ("fp32", "bf16"):
            raise ValueError(f"kernel_weights must be 'fp32' or 'bf16', got {kernel_weights!r}")
        if tree_attention not in TREE_ATTENTION_IMPLS:
            raise ValueError(f"tree_attention must be one of {', '.join(TREE_ATTENTION_IMPLS)}, got {tree_attention!r}")
        self.tree_attention = tree_attention
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

        usable = onednn_usable(self.device, self.dtype)
        if onednn and not usable:
            raise ValueError(f"oneDNN prepacked linear is not usable for {self.dtype} on {self.device}")
        self.onednn = usable if onednn is None else onednn
        # decoding steps and chain verifications attend with the C kernel (fp32 CPU, a compiler at hand):
        # the same arithmetic for 1 and for T new positions, and ~1/10 of SDPA's per-call overhead
        self.cpu_attention = self.device.type == "cpu" and self.dtype == torch.float32 and cpu_linear.available()
        self.embed = emb
        bf16 = kernel_weights == "bf16"
        self.layers = [_Layer(layer, self.onednn, bf16) for layer in base.layers[: config.num_hidden_layers]]
        self.norm = base.norm.weight.detach()  # [E]
        self.lm_head = PackedLinear(model.lm_head.weight, getattr(model.lm_head, "bias", None), onednn=self.onednn,
                                    kernel_bf16=bf16)
        self.kernel_weights = "bf16" if self.lm_head.weight is not None and self.lm_head.weight.dtype == torch.bfloat16 \
            else "fp32"
        # forwards of up to C_LAYERS_MAX_T tokens of one sequence run the whole layer stack in one
        # C call (`cpu_linear.llama_layers`) when every layer is SwiGLU on the C kernels (and the
        # final norm and LM head with them)
        self.c_layers = self.cpu_attention and all(
            layer.swiglu and layer.qkv.weight is not None and layer.gate_up.weight is not None for layer in self.layers
        ) and self.lm_head.weight is not None
        self._table: tuple[int, object] | None = None  # (cache data pointer, C layer table)
        self._block: tuple[int, "BlockVerifier"] | None = None  # (cache data pointer, reused block verifier)
        self._draft_head: tuple[Tensor, Tensor | None, Tensor] | None = None  # `set_draft_vocab`

        # rotary tables for every position: [S, D] each, in the model dtype (as transformers casts them)
        inv_freq = rotary.original_inv_freq.detach().to(device=self.device, dtype=torch.float32)  # [D/2]
        positions = torch.arange(self.max_context, device=self.device, dtype=torch.float32)  # [S]
        freqs = positions[:, None] * inv_freq[None, :]  # [S, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [S, D]
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._cos = (angles.cos() * scaling).to(self.dtype)  # [S, D]
        sin = (angles.sin() * scaling).to(self.dtype)  # [S, D]
        # rotate_half(x) * sin == roll(x, D/2) * signed_sin with the first half of sin negated (exact)
        half = self.head_dim // 2
        self._sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # [S, D]
        # v heads pass through the rotary step unchanged (cos 1, sin 0: exact)
        self._v_ones = torch.ones(1, self.n_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        self._v_zeros = torch.zeros(1, self.n_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        heads = self.n_heads + 2 * self.n_kv_heads
        self._cos_heads: Tensor | None = None  # [S, Hq+2Hkv, D]
        self._sin_heads: Tensor | None = None  # [S, Hq+2Hkv, D]
        if 2 * self.max_context * heads * self.head_dim * self._cos.element_size() <= ROPE_HEAD_TABLE_BYTES:
            self._cos_heads = self._per_head(self._cos.unsqueeze(0))[0]
            self._sin_heads = self._per_head(self._sin.unsqueeze(0), sin=True)[0]
        self._positions = torch.arange(self.max_context, device=self.device)  # [S]

        self.cache = KVCache(
            layers=len(self.layers),
            kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            max_len=self.max_context,
            dtype=self.dtype,
            device=self.device,
        )
        log.debug("%r: %d heads / %d kv heads, head_dim %d, rope %s", self, self.n_heads, self.n_kv_heads,
                  self.head_dim, rope_type)

    @staticmethod
    def _context(config, max_context: int | None) -> int:
        limit = model_context_limit(config)
        window = sliding_window(config)
        if max_context is None:
            chosen = min(c for c in (limit, window, DEFAULT_MAX_CONTEXT) if c is not None)
            if limit is not None and chosen < limit:
                log.info(
                    "FastLlamaRunner preallocates %d of the model's %d positions%s; pass max_context to change it",
                    chosen, limit, f" (sliding window {window})" if chosen == window else "",
                )
            return chosen
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

    def compact(self, start: int, keep: Tensor | list[int]) -> None:  # keep: [n] long offsets from start
        if (isinstance(keep, list) and type(start) is int and 0 <= start and all(type(k) is int for k in keep)
                and all(a < b for a, b in zip(keep, keep[1:]))
                and (not keep or (keep[0] >= 0 and start + keep[-1] < self.cache.length))):
            self.cache.compact_ascending(start, keep)  # a tree's accepted path: no index tensor, no gather
            return
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
            b, t = input_ids.shape
            if (self.c_layers and b == 1 and t <= C_LAYERS_MAX_T
                    and (t == 1 or self.cache.length > 0 or args.tree_mask is not None)):
                hidden, logits, choice = self._c_forward(input_ids.to(self.device), args.position_ids, args.tree_mask)
                return RunnerOutput(logits=logits, hidden=hidden if need_hidden else None, argmax=choice)
            hidden = self._forward(input_ids.to(self.device), args.position_ids, args.tree_mask)  # [B, T, E]
            b, t, e = hidden.shape
            logits = self.lm_head(hidden.view(b * t, e)).view(b, t, -1)  # [B, T, V]
            if logits.dtype != torch.float32:
                logits = logits.float()
        return RunnerOutput(logits=logits, hidden=hidden if need_hidden else None)

    def _per_head(self, table: Tensor, sin: bool = False) -> Tensor:  # [R, T, D] -> [R, T, Hq+2Hkv, D]
        """Repeat a rotary table over the q and k heads; v heads get cos 1 / sin 0."""
        rows, t, _ = table.shape
        v_part = self._v_zeros if sin else self._v_ones  # [1, Hkv, D]
        qk = table.unsqueeze(2).expand(rows, t, self.n_heads + self.n_kv_heads, -1)
        return torch.cat([qk, v_part.expand(rows, t, -1, -1)], dim=2)

    def _rotary(self, t: int, position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """cos/sin for the q, k and v heads of this forward, each [B or 1, T, Hq + 2Hkv, D]."""
        start = self.cache.length
        if self._cos_heads is not None:
            if position_ids is None:
                return self._cos_heads[start : start + t], self._sin_heads[start : start + t]  # [T, H, D]
            return self._cos_heads[position_ids], self._sin_heads[position_ids]  # [B, T, H, D]
        if position_ids is None:
            cos = self._cos[start : start + t].unsqueeze(0)  # [1, T, D]
            sin = self._sin[start : start + t].unsqueeze(0)
        else:
            cos = self._cos[position_ids]  # [B, T, D]
            sin = self._sin[position_ids]
        return self._per_head(cos), self._per_head(sin, sin=True)

    def _attention_plan(self, t: int, tree_mask: Tensor | None) -> tuple[str, Tensor | None]:
        """How this forward's T new positions attend, and the mask that goes with it:

        "plain" (one position, no mask), "causal" (a prefill on an empty cache: SDPA's
        top-left causal mask is right), "dense" (the C kernel, `cpu_linear.causal_attention`:
        a decoding step or a chain of up to GROUPED_ATTENTION_MAX_T positions after the
        prefix, on fp32 CPU), "kernel" (the Triton tree-attention kernel),
        "grouped" (`grouped_attention` with an additive bias [G*T, L+T]) or "sdpa" (SDPA with
        a bool mask [T, L+T]: a forward wider than GROUPED_ATTENTION_MAX_T, or
        tree_attention="sdpa")."""
        start = self.cache.length
        if self.cpu_attention and tree_mask is None and (t == 1 or 0 < start and t <= GROUPED_ATTENTION_MAX_T):
            return "dense", None
        if tree_mask is None and t == 1:
            return "plain", None
        if tree_mask is None and start == 0:
            return "causal", None
        impl = self.tree_attention
        if tree_mask is not None and (
            impl == "kernel" or (impl == "auto" and self.device.type == "cuda" and t <= MAX_TREE_NODES)
        ):
            return "kernel", None
        new = tree_mask if tree_mask is not None else self._causal(t)  # [T, T] bool
        if t <= GROUPED_ATTENTION_MAX_T and (tree_mask is None or impl == "auto"):
            bias = torch.zeros(t, start + t, dtype=self.dtype, device=self.device)  # [T, L+T]
            bias[:, start:].masked_fill_(~new, float("-inf"))
            return "grouped", bias.repeat(self.n_heads // self.n_kv_heads, 1)  # [G*T, L+T]
        mask = torch.ones(t, start + t, dtype=torch.bool, device=self.device)  # [T, L+T]
        mask[:, start:] = new
        return "sdpa", mask

    def _causal(self, t: int) -> Tensor:  # [T, T] bool, lower triangle
        positions = self._positions[:t]  # [T]
        return positions[None, :] <= positions[:, None]

    @staticmethod
    def _mlp(layer: _Layer, x: Tensor, eps: float) -> Tensor:  # [B*T, E] -> [B*T, E], the residual added
        gate_up = layer.gate_up.normed(x, layer.ln2, eps)  # [B*T, 2I]: gate | up
        if layer.swiglu:
            return layer.down.swiglu_add_to(x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [B*T, I] each
        return layer.down.add_to(x, layer.act(gate) * up)

    def c_layer_table(self, caches: list[tuple[Tensor, Tensor]]):
        """The C table (`cpu_linear.layer_table`) of every layer's weights with layer i's key /
        value storage ``caches[i]`` (this runner's dense cache, or a paged store's halves)."""
        return cpu_linear.layer_table([
            dict(ln1=l.ln1, qkv_w=l.qkv.weight, qkv_b=l.qkv.bias, o_w=l.o.weight, o_b=l.o.bias, ln2=l.ln2,
                 gu_w=l.gate_up.weight, gu_b=l.gate_up.bias, down_w=l.down.weight, down_b=l.down.bias,
                 k_cache=k, v_cache=v) for l, (k, v) in zip(self.layers, caches)])

    def prompt_forward(self, input_ids: Tensor, *, logits: bool = True, need_hidden: bool = False) -> RunnerOutput:
        """`runner.prompt_forward`: a forward whose caller reads the last position's logits
        (``logits``) or none. One sequence on the C layer stack runs the LM head on that row
        only (any T: its linear kernel is as fast per token as oneDNN's at prompt sizes, and
        the same arithmetic as the decoding steps after it); otherwise `forward`."""
        args = check_forward_args(input_ids, None, None, batch_size=self.cache.batch, cache_len=self.cache.length,
                                  max_context=self.max_context, device=self.device)
        if not (self.c_layers and input_ids.shape[0] == 1):
            return self.forward(input_ids, need_hidden=need_hidden)
        with torch.inference_mode():
            hidden, out, choice = self._c_forward(input_ids.to(self.device), args.position_ids, None,
                                                  logit_rows=1 if logits else 0)
        return RunnerOutput(logits=out, hidden=hidden if need_hidden else None, argmax=choice)

    def _layer_table(self):
        """The C table over this runner's cache (rebuilt when the cache is reallocated)."""
        key = self.cache.data.data_ptr()
        if self._table is None or self._table[0] != key:
            caches = [(self.cache.keys[i], self.cache.values[i]) for i in range(len(self.layers))]
            self._table = (key, self.c_layer_table(caches))
        return self._table[1]

    def _c_forward(self, input_ids: Tensor, position_ids: Tensor | None, tree_mask: Tensor | None, *,
                   logit_rows: int | None = None) -> tuple[Tensor, Tensor, list[int] | None]:
        """The layer stack, final norm and LM head in one C call (one sequence; logits of the
        last ``logit_rows`` positions, None: all): hidden [1, T, E], logits [1, R, V] and each
        logit row's argmax [R] (computed in the call: `RunnerOutput.argmax`; None for R = 0)."""
        t = input_ids.shape[1]
        cache = self.cache
        start = cache.length
        if position_ids is None:
            cos, sin = self._cos[start : start + t], self._sin[start : start + t]  # [T, D]
        else:
            cos, sin = self._cos[position_ids[0]], self._sin[position_ids[0]]  # [T, D]
        mask = None if tree_mask is None else cpu_linear.mask_bits(tree_mask)  # [T] words
        x = cpu_linear.embedding(input_ids[0], self.embed)  # [T, E] (torch's OpenMP team left asleep)
        keys = cache.keys[0]
        hidden, logits, choice = cpu_linear.llama_layers(
            self._layer_table(), x, heads=self.n_heads, kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            intermediate=self.layers[0].down.weight.shape[1], eps=self.eps, scale=self.scale, cos=cos, sin=sin,
            kv_strides=(keys.stride(0), keys.stride(1)), start=start, norm=self.norm, head=self.lm_head.weight,
            head_bias=self.lm_head.bias, mask=mask, logit_rows=logit_rows, argmax=True)  # [T, E], [R, V], [R]
        cache.advance(t)
        return hidden.view(1, t, self.hidden_size), logits.unsqueeze(0), None if choice is None else choice.tolist()

    def _step_loop(self, max_nodes: int, **heads) -> "cpu_linear.StepLoop":
        keys = self.cache.keys[0]
        return cpu_linear.StepLoop(
            self._layer_table(), self.embed, heads=self.n_heads, kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            intermediate=self.layers[0].down.weight.shape[1], eps=self.eps, scale=self.scale, cos=self._cos,
            sin=self._sin, kv_strides=(keys.stride(0), keys.stride(1)), norm=self.norm, head=self.lm_head.weight,
            head_bias=self.lm_head.bias, max_nodes=max_nodes, **heads)

    def _one_call_steps(self) -> bool:
        return (self.c_layers and self.cache.batch == 1 and self.embed.is_contiguous()
                and self.embed.dtype == torch.float32)

    def medusa_loop(self, weights: "cpu_linear.MedusaWeights", num_heads: int, top_k: int,
                    max_nodes: int) -> "MedusaSteps | None":
        """Greedy Medusa steps in one C call each (`cpu_linear.StepLoop.medusa_step`) on this
        runner's cache, for trees of up to ``max_nodes`` nodes; None where `forward` would not
        run such a tree on the C layer stack (then the caller verifies step by step)."""
        if not (self._one_call_steps() and 1 <= max_nodes <= C_LAYERS_MAX_T):
            return None
        return MedusaSteps(self, self._step_loop(max_nodes, weights=weights, num_heads=num_heads, top_k=top_k))

    def block_verifier(self) -> "BlockVerifier | None":
        """Greedy verification of a drafted block in one C call (`cpu_linear.StepLoop.chain_verify`)
        on this runner's cache; None where the C layer stack does not run this runner's forwards."""
        if not self._one_call_steps():
            return None
        key = self.cache.data.data_ptr()  # one per cache allocation: its buffers are reused request after request
        if self._block is None or self._block[0] != key:
            self._block = (key, BlockVerifier(self, self._step_loop(C_LAYERS_MAX_T)))
        return self._block[1]

    def set_draft_vocab(self, tokens: Tensor | list[int] | None) -> None:
        """Let greedy drafting chains (`draft_chain`) rank only ``tokens`` (distinct ids of this
        vocabulary; None: all of it): they run the LM head over those rows alone, so a drafted
        token reads F rows of it instead of V (FR-Spec's frequency-ranked draft vocabulary).
        A drafter only proposes, so outputs stay exact; a token outside the list is never
        proposed. The engine's batched drafting ranks it too in calls where no sequence samples
        (`PagedLlama.draft_ragged`, through `draft_head`). Sampled chains and `forward` keep the
        whole vocabulary, as does drafting where the C chain does not run (not fp32 CPU)."""
        if tokens is None:
            self._draft_head = None
            return
        ids = torch.as_tensor(tokens)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype == torch.bool or ids.is_floating_point():
            raise ValueError("a draft vocabulary must be a non-empty 1-D list of token ids")
        ids = ids.to(torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"a draft vocabulary must hold distinct token ids in [0, {self.vocab_size})")
        if self.lm_head.weight is None:  # no C kernel copy of the head: nothing can read it
            self._draft_head = None
            return
        rows = cpu_linear.unpack(self.lm_head.weight)[ids]  # [F, E], the kernel copy's dtype
        bias = None if self.lm_head.bias is None else self.lm_head.bias[ids].contiguous()
        self._draft_head = (cpu_linear.pack(rows.contiguous()), bias, ids.contiguous())

    @property
    def draft_head(self) -> tuple[Tensor, Tensor | None, Tensor] | None:
        """The draft vocabulary's LM-head rows (the kernel copy's layout), their bias and token
        ids, or None without one (`set_draft_vocab`)."""
        return self._draft_head

    def draft_chain(self, tokens: list[int], count: int, *, uniforms: Tensor | None = None,
                    temperature: float = 1.0) -> tuple[list[int], Tensor | None] | None:
        """Drafting in one C call (`cpu_linear.llama_draft`): feed ``tokens`` (what the cache
        lacks), then ``count - 1`` chosen tokens one by one; returns the ``count`` tokens and,
        when sampling, q [count, V]; the cache grows by ``len(tokens) + count - 1``.
        Greedy (no ``uniforms``): the argmax tokens, equal to a loop of `forward` and argmax bit
        for bit (the same C forwards), over the draft vocabulary's rows when one is set
        (`set_draft_vocab`). Sampling: each token drawn from q = softmax(logits /
        temperature) with ``uniforms`` [count] (float64 in [0, 1)). None, with nothing done,
        where `forward` would not take the C path for these tokens or the cache lacks room:
        the caller loops instead."""
        t, start = len(tokens), self.cache.length
        if not (self.c_layers and self.cache.batch == 1 and 1 <= t <= C_LAYERS_MAX_T and count >= 1
                and (t == 1 or start > 0) and start + t + count - 1 <= self.max_context
                and self.embed.is_contiguous()):
            return None
        keys = self.cache.keys[0]
        head, bias, head_ids = self.lm_head.weight, self.lm_head.bias, None
        if uniforms is None and self._draft_head is not None:  # greedy: the draft vocabulary's rows
            head, bias, head_ids = self._draft_head
        out = cpu_linear.llama_draft(
            self._layer_table(), self.embed, tokens, count, heads=self.n_heads, kv_heads=self.n_kv_heads,
            head_dim=self.head_dim, intermediate=self.layers[0].down.weight.shape[1], eps=self.eps, scale=self.scale,
            cos=self._cos, sin=self._sin, kv_strides=(keys.stride(0), keys.stride(1)), start=start, norm=self.norm,
            head=head, head_bias=bias, uniforms=uniforms, temperature=temperature, head_ids=head_ids)
        self.cache.advance(t + count - 1)
        return out

    def _forward(self, input_ids: Tensor, position_ids: Tensor | None, tree_mask: Tensor | None) -> Tensor:
        b, t = input_ids.shape  # [B, T]
        hq, hkv, d, e = self.n_heads, self.n_kv_heads, self.head_dim, self.hidden_size
        cache, eps, scale = self.cache, self.eps, self.scale
        mode, mask = self._attention_plan(t, tree_mask)  # mask: [G*T, L+T] float | [T, L+T] bool | None
        fused = None  # the C kernel's rotary rows [T, D] when it does the whole attention block
        if mode == "dense" and position_ids is None:
            start = cache.length
            fused = (self._cos[start : start + t], self._sin[start : start + t])
            cos = sin = None
        else:
            cos, sin = self._rotary(t, position_ids)  # [B|1, T, Hq+2Hkv, D] or [T, Hq+2Hkv, D]
        gqa = hq != hkv
        half = d // 2
        x = F.embedding(input_ids, self.embed).view(b * t, e)  # [B*T, E]
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv.normed(x, layer.ln1, eps).view(b, t, hq + 2 * hkv, d)  # [B, T, Hq+2Hkv, D]
            if fused is not None:  # rotary, cache write and attention in one C call
                o = cpu_linear.rope_cache_attention(qkv, fused[0], fused[1], cache.keys[i], cache.values[i],
                                                    cache.length, scale)  # [B*T, Hq*D]
                x = layer.o.add_to(x, o)  # [B*T, E]
                x = self._mlp(layer, x, eps)
                continue
            qkv = torch.addcmul(qkv * cos, qkv.roll(half, -1), sin)  # rotary on q and k; v passes unchanged
            kv = qkv[:, :, hq:].view(b, t, 2, hkv, d).permute(2, 0, 3, 1, 4)  # [2, B, Hkv, T, D]
            k, v = cache.write(i, kv)  # [B, Hkv, L+T, D] each
            if mode == "dense":
                o = cpu_linear.causal_attention(qkv[:, :, :hq], k, v, scale)  # [B*T, Hq*D]
            elif mode == "grouped":
                o = grouped_attention(qkv[:, :, :hq], k, v, mask, scale)  # [B*T, Hq*D]
            else:
                q = qkv[:, :, :hq].transpose(1, 2)  # [B, Hq, T, D]
                if mode == "kernel":
                    o = kernel_tree_attention(q, k, v, tree_mask, scale)  # [B, Hq, T, D]
                else:
                    o = F.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, is_causal=mode == "causal", scale=scale, enable_gqa=gqa
                    )  # [B, Hq, T, D]
                o = o.transpose(1, 2).reshape(b * t, hq * d)  # [B*T, Hq*D]
            x = layer.o.add_to(x, o)  # [B*T, E]
            x = self._mlp(layer, x, eps)
        cache.advance(t)
        x = F.rms_norm(x, (e,), self.norm, eps)  # [B*T, E]
        return x.view(b, t, e)  # [B, T, E]


class MedusaSteps:
    """Greedy Medusa steps on a fast runner's cache (`FastLlamaRunner.medusa_loop`), one C
    call each (`cpu_linear.StepLoop.medusa_step`). ``cands`` [K * TK] long: the candidates the next
    step's tree reads (set them once from the prompt pass's heads, then each step writes the
    next ones). The cache must not be reallocated while it is in use (one request)."""

    def __init__(self, runner: FastLlamaRunner, loop: cpu_linear.StepLoop) -> None:
        self.runner = runner
        self.loop = loop
        self.cands = loop.cands
        self.top_k = loop.top_k
        self.max_nodes = loop.max_nodes
        self._last = (1, 1)  # the last step's (tree nodes, accepted path length)

    def step(self, tree: Tensor, root: int, branch: list[int] | None = None) -> tuple[list[int], float]:
        """One step over ``tree`` ([4, N], `cpu_linear.medusa_tree_words`) rooted at ``root``
        after the cached positions, with ``branch`` (tokens drafted after the root) merged into
        it up to ``max_nodes`` nodes in all: returns [P, next token, the P - 1 accepted tokens,
        ...] (read the first P + 1) and the heads' seconds; the cache then ends with the P
        accepted path's entries."""
        cache = self.runner.cache
        start, n = cache.length, tree.shape[1]
        extra = len(branch) if branch else 0
        if n > self.max_nodes or start + n + extra > self.runner.max_context:
            raise ValueError(f"a tree of {n} nodes and a branch of {extra} after {start} cached positions does not "
                             f"fit (at most {self.max_nodes} nodes, context {self.runner.max_context})")
        heads_s, fed = self.loop.medusa_step(start, tree, root, branch)
        result = self.loop.result.tolist()
        cache.length = start + result[0]
        self._last = (fed, result[0])
        return result, heads_s

    def last_hidden(self) -> Tensor:
        """A copy of the normed hidden state [E] of the last step's last accepted node."""
        n, length = self._last
        return self.loop.hidden(n, self.loop.path_node(length - 1))


class BlockVerifier:
    """Greedy verification of a pending token and a drafted block on a fast runner's cache
    (`FastLlamaRunner.block_verifier`), one C call each (`cpu_linear.StepLoop.chain_verify`):
    the forward `forward` runs for the same block (the C layer stack, all rows' argmax) and
    `accept_greedy`'s count. The cache must not be reallocated while it is in use (one request)."""

    def __init__(self, runner: FastLlamaRunner, loop: cpu_linear.StepLoop) -> None:
        self.runner = runner
        self.loop = loop
        self.max_tokens = loop.max_nodes

    def applies(self, tokens: int) -> bool:
        """Whether `forward` over ``tokens`` new positions would run this very C call."""
        length = self.runner.cache.length
        return tokens <= self.max_tokens and (tokens == 1 or length > 0) and length + tokens <= self.runner.max_context

    def verify(self, tokens: list[int]) -> tuple[int, int]:
        """Feed ``tokens`` (see `applies`): (drafted tokens accepted, the next token); the cache
        then holds all of them, as after `forward` (cut it back with `truncate`)."""
        cache = self.runner.cache
        start = cache.length
        if not self.applies(len(tokens)):
            raise ValueError(f"{len(tokens)} tokens after {start} cached positions: not a one-call verification")
        n, nxt = self.loop.chain_verify(start, tokens)
        cache.length = start + len(tokens)
        return n, nxt

    def hidden(self, tokens: int, row: int) -> Tensor:
        """The normed hidden state [E] of ``row`` of the last verification over ``tokens``."""
        return self.loop.hidden(tokens, row)
