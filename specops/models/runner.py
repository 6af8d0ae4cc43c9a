"""One model behind one interface: the `ModelRunner` protocol (`specops.models.loading.load_runner` picks one).

A runner owns a model and its KV cache. Every decoding algorithm (plain decoding,
draft-model speculation, n-gram drafting, Medusa tree verification) talks to models
only through this interface, so it never needs to know whether the model runs through
our compact Llama-family forward (`FastLlamaRunner`) or through transformers' own
forward (`HFRunner`).

Cache semantics shared by every implementation:

- `forward(input_ids [B, T])` appends T entries to the cache. Each new position sees
  the whole cached prefix; among the new positions it sees the causal past, or, with
  `tree_mask [T, T]`, exactly the positions j where `tree_mask[i, j]` is True.
- `truncate(length)` rolls the cache back to its first `length` entries.
- `compact(start, keep [n])` moves entry `start + keep[i]` to `start + i` and leaves
  `start + n` entries: the accepted root-to-leaf path of a verified tree.

Dimension letters follow docs/interfaces.md: B batch, T new positions, L cached
prefix, V vocabulary, E hidden size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import Tensor

log = logging.getLogger(__name__)

IMPLS = ("auto", "fast", "hf")  # load_runner's impl choices
FAST_MODEL_TYPES = ("llama", "mistral", "qwen2")  # config.model_type values FastLlamaRunner runs


class UnsupportedModelError(ValueError):
    """The fast path cannot run this model exactly (architecture or config feature)."""


@dataclass
class RunnerOutput:
    """What one forward pass returns. Both tensors are created under `torch.inference_mode`:
    read them freely, but `.clone()` one before using it in autograd (e.g. head training)."""

    logits: Tensor  # [B, T, V] float32
    hidden: Tensor | None = None  # [B, T, E] last hidden state after the final norm
    layers: Tensor | None = None  # [B, T, k*E] hidden_states[i] for the k asked ``hidden_layers``, side by side
    argmax: list[int] | None = None  # [B*T] each logit row's argmax, when the runner computed it alongside

    def choices(self) -> list[int]:
        """Each logit row's argmax (torch.argmax's answer: the first maximum, or the first NaN)
        for a batch of one, [T]: the runner's own (`argmax`, from the fast runner's C stack,
        computed while the rows were in cache) or `cpu_linear.argmax` over the logits."""
        if self.argmax is not None:
            return self.argmax
        from specops.kernels import cpu_linear

        return cpu_linear.argmax(self.logits[0]).tolist()

    def last_choice(self) -> int:
        """The argmax of a batch of one's last logit row (`choices` of that row alone)."""
        if self.argmax is not None:
            return self.argmax[-1]
        from specops.kernels import cpu_linear

        return int(cpu_linear.argmax(self.logits[0, -1]))


@runtime_checkable
class ModelRunner(Protocol):
    """A model plus its KV cache (see the module docstring for the cache semantics)."""

    vocab_size: int
    max_context: int
    device: torch.device
    dtype: torch.dtype

    def reset(self, batch_size: int = 1) -> None:
        """Empty the KV cache and set the batch size of the next forwards."""
        ...

    @property
    def cache_len(self) -> int:
        """Number of entries in the KV cache."""
        ...

    def forward(
        self,
        input_ids: Tensor,  # [B, T] long
        *,
        position_ids: Tensor | None = None,  # [B, T] long; default cache_len + arange(T)
        tree_mask: Tensor | None = None,  # [T, T] bool: new position i may see new position j
        need_hidden: bool = False,
    ) -> RunnerOutput:
        """Run T new positions, append them to the cache, return their logits."""
        ...

    def truncate(self, length: int) -> None:
        """Keep the first `length` cache entries (rollback after a rejection)."""
        ...

    def compact(self, start: int, keep: Tensor | list[int]) -> None:  # keep: [n] long offsets from start
        """Move entry start+keep[i] to start+i; afterwards cache_len == start + n."""
        ...


def returns_layers(runner: ModelRunner) -> bool:
    """Whether ``runner.forward`` takes ``hidden_layers``: the hidden states of chosen layers,
    transformers' ``hidden_states`` indices (0: the embedding output, i: the output of layer
    i - 1, i.e. the input of layer i), returned side by side in `RunnerOutput.layers`. An EAGLE-3
    drafter reads them (`HFRunner` returns them; the fast runner's C layer stack does not)."""
    return bool(getattr(runner, "returns_layers", False))


def prompt_forward(runner: ModelRunner, input_ids: Tensor, *, logits: bool = True,
                   need_hidden: bool = False, hidden_layers: tuple[int, ...] | None = None) -> RunnerOutput:
    """A prompt pass: `forward` over ``input_ids`` [B, T] when the caller reads only the
    last position's logits (``logits``) or none of them. A runner with its own
    ``prompt_forward`` (the fast runner's C layer stack) then skips the LM head over the other
    positions, which is most of it at a 4k vocabulary; the returned logits are [B, 1, V] (or
    [B, 0, V]), so read them as ``logits[:, -1]``. Other runners return `forward`'s output.
    ``hidden``, when asked for, covers every position, as ``layers`` does (``hidden_layers``,
    `returns_layers` runners only; such a pass is a plain `forward`)."""
    if hidden_layers is not None:
        return runner.forward(input_ids, need_hidden=need_hidden, hidden_layers=hidden_layers)
    own = getattr(runner, "prompt_forward", None)
    if own is not None:
        return own(input_ids, logits=logits, need_hidden=need_hidden)
    return runner.forward(input_ids, need_hidden=need_hidden)


@dataclass(frozen=True)
class ForwardArgs:
    """Validated, normalised arguments of one forward call."""

    batch: int
    new: int  # T
    position_ids: Tensor | None  # [B, T] long on the runner's device, or None for the default
    tree_mask: Tensor | None  # [T, T] bool on the runner's device


def check_forward_args(
    input_ids: Tensor,  # [B, T]
    position_ids: Tensor | None,  # [B, T] | [T] | None
    tree_mask: Tensor | None,  # [T, T] | None
    *,
    batch_size: int,
    cache_len: int,
    max_context: int,
    device: torch.device,
) -> ForwardArgs:
    """Validate a forward call against the runner's state; raise ValueError naming the problem."""
    import torch

    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of shape [B, T], got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    b, t = input_ids.shape
    if t == 0:
        raise ValueError("input_ids has no positions (T == 0)")
    if b != batch_size:
        raise ValueError(
            f"input_ids has batch {b} but the runner's cache was reset for batch {batch_size}; "
            f"call reset(batch_size={b}) first"
        )
    if cache_len + t > max_context:
        raise ValueError(
            f"forward of {t} new positions on a cache of {cache_len} exceeds max_context {max_context}"
        )
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor):
            raise TypeError("position_ids must be a torch.Tensor of shape [B, T]")
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(b, -1)
        if tuple(position_ids.shape) != (b, t):
            raise ValueError(f"position_ids must have shape [B, T] = {(b, t)}, got {tuple(position_ids.shape)}")
        position_ids = position_ids.to(device=device, dtype=torch.long)
        lo, hi = int(position_ids.min()), int(position_ids.max())
        if lo < 0 or hi >= max_context:
            raise ValueError(f"position_ids must lie in [0, {max_context}), got range [{lo}, {hi}]")
    if tree_mask is not None:
        if not isinstance(tree_mask, torch.Tensor):
            raise TypeError("tree_mask must be a torch.Tensor of shape [T, T]")
        if tuple(tree_mask.shape) != (t, t):
            raise ValueError(f"tree_mask must have shape [T, T] = {(t, t)}, got {tuple(tree_mask.shape)}")
        if tree_mask.dtype != torch.bool:
            raise ValueError(f"tree_mask must be a bool tensor, got dtype {tree_mask.dtype}")
        tree_mask = tree_mask.to(device)
        if not bool(tree_mask.diagonal().all()):
            raise ValueError("tree_mask must let every node see itself (its diagonal must be all True)")
    return ForwardArgs(batch=b, new=t, position_ids=position_ids, tree_mask=tree_mask)


def check_truncate(length: int, cache_len: int) -> int:
    """Validate a truncate() length; return it as an int."""
    if not isinstance(length, int) or isinstance(length, bool):
        raise TypeError(f"truncate length must be an int, got {type(length).__name__}")
    if length < 0 or length > cache_len:
        raise ValueError(f"truncate length must be in [0, {cache_len}] (the cache length), got {length}")
    return length


def check_compact(start: int, keep: Tensor, cache_len: int, device: torch.device) -> Tensor:
    """Validate compact() arguments; return `keep` as absolute cache indices [n] long on `device`."""
    import torch

    if not isinstance(start, int) or isinstance(start, bool):
        raise TypeError(f"compact start must be an int, got {type(start).__name__}")
    if start < 0 or start > cache_len:
        raise ValueError(f"compact start must be in [0, {cache_len}] (the cache length), got {start}")
    if not isinstance(keep, torch.Tensor):
        keep = torch.as_tensor(keep, dtype=torch.long)
    if keep.dim() != 1:
        raise ValueError(f"compact keep must have shape [n], got {tuple(keep.shape)}")
    if keep.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"compact keep must be an integer tensor, got dtype {keep.dtype}")
    if keep.numel():
        lo, hi = int(keep.min()), int(keep.max())
        if lo < 0 or start + hi >= cache_len:
            raise ValueError(
                f"compact keep offsets must lie in [0, {cache_len - start}) "
                f"(cache_len {cache_len} - start {start}), got range [{lo}, {hi}]"
            )
    return keep.to(device=device, dtype=torch.long) + start


def check_batch_size(batch_size: int) -> int:
    """Validate reset()'s batch size."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return batch_size


def model_context_limit(config) -> int | None:
    """The number of positions a transformers config declares, or None when it declares none."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def sliding_window(config) -> int | None:
    """The attention window of a config whose layers (any of them) use sliding-window attention."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window
