"""The generic path: any decoder-only transformers model through its own forward and cache.

Slower than `FastLlamaRunner` (transformers' `DynamicCache` concatenates on every step and
the forward issues many small ops), but it runs every architecture transformers knows —
GPT-2, GPT-NeoX, Llama, Qwen2, Mistral, ... — with the same exact results as calling the
model directly.

- cache: a `DynamicCache` passed as the forward's `cache=` argument (`past_key_values=` where
  the installed transformers predates that name: 5.17 still read only the old one, and an
  unknown keyword vanishes into the forward's ``**kwargs``, so the cache was silently unused);
- truncate: `DynamicCache.crop(-removed)`;
- compact: an index copy on every cache layer's keys/values, then a crop;
- tree forwards: a 4-D additive float mask [B, 1, T, L + T]; transformers' masking_utils
  returns a 4-D mask unchanged and both its eager and SDPA attention add it to the scores.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from specops.models.runner import (
    RunnerOutput,
    UnsupportedModelError,
    check_batch_size,
    check_compact,
    check_forward_args,
    check_truncate,
    model_context_limit,
    sliding_window,
)

# transformers attention implementations that add a custom 4-D float mask to the scores
MASKABLE_ATTENTION = ("eager", "sdpa")


def cache_argument(model) -> str:
    """The name under which ``model.forward`` takes its cache: ``cache`` (transformers' name
    from 5.2x on; ``past_key_values`` is then a deprecated alias) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise UnsupportedModelError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")


class HFRunner:
    """A transformers causal LM plus a `DynamicCache`, behind the `ModelRunner` interface."""

    returns_layers = True
    """`forward` takes ``hidden_layers`` (`specops.models.runner.returns_layers`)."""

    def __init__(self, model, *, max_context: int | None = None) -> None:
        from transformers import DynamicCache

        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedModelError(f"{config.model_type} is an encoder-decoder model")
        limit = model_context_limit(config)
        if max_context is None:
            if limit is None:
                raise ValueError(
                    f"{config.model_type} config declares no context length; pass max_context explicitly"
                )
            max_context = limit
        if not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"max_context must be a positive int, got {max_context!r}")
        if limit is not None and max_context > limit:
            raise ValueError(f"max_context {max_context} exceeds the model's {limit} positions")
        self.model = model.eval()
        self.config = config
        head = model.get_output_embeddings()
        self.vocab_size = int(head.weight.shape[0]) if head is not None else int(config.vocab_size)  # logits' V
        self.max_context = max_context
        first = next(model.parameters())
        self.device = first.device
        self.dtype = first.dtype
        self._window = sliding_window(config)
        self._cache_cls = DynamicCache
        self._cache_arg = cache_argument(model)
        self._batch = 1
        self._len = 0
        self._cache = DynamicCache(config=config)

    def __repr__(self) -> str:
        return f"HFRunner({self.config.model_type}, max_context={self.max_context}, cache_len={self._len})"

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self, batch_size: int = 1) -> None:
        self._batch = check_batch_size(batch_size)
        self._cache = self._cache_cls(config=self.config)
        self._len = 0

    def forward(
        self,
        input_ids: Tensor,  # [B, T] long
        *,
        position_ids: Tensor | None = None,  # [B, T] long
        tree_mask: Tensor | None = None,  # [T, T] bool
        need_hidden: bool = False,
        hidden_layers: tuple[int, ...] | None = None,  # transformers' hidden_states indices, 0 .. layers
    ) -> RunnerOutput:
        args = check_forward_args(
            input_ids,
            position_ids,
            tree_mask,
            batch_size=self._batch,
            cache_len=self._len,
            max_context=self.max_context,
            device=self.device,
        )
        mask = None
        if args.tree_mask is not None:
            attn = getattr(self.config, "_attn_implementation", None)
            if attn not in MASKABLE_ATTENTION:
                raise UnsupportedModelError(
                    f"tree forwards need an attention implementation that applies a 4-D mask "
                    f"({', '.join(MASKABLE_ATTENTION)}); this model uses {attn!r}"
                )
            if self._window is not None and self._len + args.new > self._window:
                raise UnsupportedModelError(
                    f"tree forward past the sliding window ({self._len + args.new} > {self._window} positions) "
                    "is not supported by HFRunner"
                )
            mask = self._additive_mask(args.tree_mask, args.batch)  # [B, 1, T, L + T]
        select: bool | list[int] = need_hidden
        if hidden_layers is not None:
            last = self._num_layers()
            if not hidden_layers or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= last
                                        for i in hidden_layers):
                raise ValueError(f"hidden_layers must be hidden_states indices in 0..{last}, got {hidden_layers!r}")
            # transformers keeps only the selected hidden states (index `last`: after the final norm)
            select = sorted(set(hidden_layers) | ({last} if need_hidden else set()))
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids.to(self.device),
                position_ids=args.position_ids,
                attention_mask=mask,
                use_cache=True,
                **{self._cache_arg: self._cache},
                output_hidden_states=select,
                return_dict=True,
            )
        self._len += args.new
        logits = out.logits.float()  # [B, T, V]
        hidden = out.hidden_states[-1] if need_hidden else None  # [B, T, E]
        layers = None
        if hidden_layers is not None:
            states = out.hidden_states
            got = [states[i] if states is not None and i < len(states) else None for i in hidden_layers]
            if any(h is None for h in got):
                raise UnsupportedModelError(f"{type(self.model).__name__} did not return hidden_states "
                                            f"{list(hidden_layers)}")
            layers = torch.cat(got, dim=-1)  # [B, T, k*E]
        return RunnerOutput(logits=logits, hidden=hidden, layers=layers)

    def _num_layers(self) -> int:
        """The number of decoder layers: ``hidden_states`` has this many entries plus one."""
        n = getattr(self.config, "num_hidden_layers", None)
        if not isinstance(n, int):
            n = getattr(self.config, "n_layer", None)
        if not isinstance(n, int):
            raise UnsupportedModelError(f"{self.config.model_type} config declares no number of layers")
        return n

    def _additive_mask(self, tree_mask: Tensor, batch: int) -> Tensor:  # [T, T] -> [B, 1, T, L + T]
        t = tree_mask.shape[0]
        allowed = torch.ones(t, self._len + t, dtype=torch.bool, device=self.device)  # [T, L + T]
        allowed[:, self._len :] = tree_mask
        mask = torch.zeros(t, self._len + t, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask.view(1, 1, t, self._len + t).expand(batch, 1, t, self._len + t)

    def truncate(self, length: int) -> None:
        length = check_truncate(length, self._len)
        if length == self._len:
            return
        self._check_full_layers("truncate")
        with torch.inference_mode():
            self._cache.crop(length - self._len)
        self._len = length

    def compact(self, start: int, keep: Tensor) -> None:  # keep: [n] long offsets from start
        index = check_compact(start, keep, self._len, self.device)  # [n] absolute positions
        n = index.numel()
        self._check_full_layers("compact")
        with torch.inference_mode():
            for layer in self._cache.layers:
                if not layer.is_initialized:
                    continue
                # [B, H, n, D] gathered first, so overlapping source/destination ranges are safe
                layer.keys[:, :, start : start + n] = layer.keys.index_select(2, index)
                layer.values[:, :, start : start + n] = layer.values.index_select(2, index)
            removed = self._len - (start + n)
            if removed:
                self._cache.crop(-removed)
        self._len = start + n

    def _check_full_layers(self, what: str) -> None:
        for i, layer in enumerate(self._cache.layers):
            if layer.is_initialized and layer.keys.shape[-2] != self._len:
                raise UnsupportedModelError(
                    f"cannot {what}: cache layer {i} holds {layer.keys.shape[-2]} of {self._len} positions "
                    f"(a sliding-window or otherwise partial layer, {type(layer).__name__})"
                )
