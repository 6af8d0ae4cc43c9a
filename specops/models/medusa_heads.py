"""Medusa heads: K light heads that guess the tokens after the next one.

Medusa (Cai et al. 2024, arXiv 2401.10774) reads the target's last hidden state
``h_t`` (after the final norm) and predicts, with head ``k`` (1-based), the token
``k`` positions beyond the next one: the LM head gives ``x_{t+1}``, head 1 gives
``x_{t+2}``, ..., head K gives ``x_{t+K+1}``. Each head is

    z = h + SiLU(W_k h + b_k)          (a residual block; ``num_layers`` of them)
    logits_k = U_k z                   (a linear map to the vocabulary)

``W_k`` starts at zero, so an untrained block is the identity, and ``U_k`` starts as a
copy of the target's LM head, so an untrained head predicts what the LM head does.

With ``shared_lm_head=True`` every head reuses the target's LM head instead of its
own ``U_k`` (as Hydra/EAGLE do): the artifact then holds only the residual blocks,
and all K heads share one ``[K, E] x [E, V]`` matmul, which reads the vocabulary
matrix once instead of K times. Such heads must be bound to their base model
(``from_pretrained(path, base=target)`` or :meth:`MedusaHeads.bind`) before use.

With ``root_input=True`` the heads also read the *root*: the token the target chose after
``h_t`` (``x_{t+1}``, the tree's root), known by the time they run. Their input becomes
``h_t + R e(x_{t+1})`` (``e``: the base model's input embedding, ``R`` [E, E] learned and
zero-initialised), as Hydra's heads (Ankner et al. 2024, arXiv 2402.05109) read the tokens
before theirs; here only the root, so the tree's nodes stay independent per depth and
one head call per step still proposes the whole tree. In greedy decoding the root is a
function of ``h_t``, but not one two small residual blocks can compute: given it, each
head only has to learn what follows a known token.

On disk a heads artifact is a directory with ``medusa_config.json`` (the
:class:`MedusaConfig`, naming the base model and its fingerprint) and
``medusa_heads.safetensors`` (fp16 by default). The heads trained for a registered model
(``specops train heads --model NAME --chat``) are cached in ``$SPECOPS_CACHE_DIR/medusa/NAME``
(`default_dir`), where ``Decoder.from_pretrained(NAME)`` and ``bench decode --model NAME`` find them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specops.kernels import cpu_linear

logger = logging.getLogger(__name__)
KERNEL_MAX_ROWS = 16  # heads x rows up to which inference runs on the C linear kernel (fp32 CPU)

CONFIG_NAME = "medusa_config.json"
WEIGHTS_NAME = "medusa_heads.safetensors"
FORMAT_VERSION = 1


TRAIN_COMMAND = "specops train heads --model NAME --chat"
"""How heads for a registered model get into its cache folder (``NAME`` stands for the model)."""


def default_dir(name: str) -> Path:
    """Where the trained heads of registered model ``name`` are cached (beside the models cache)."""
    from specops.models.registry import cache_root

    return cache_root().parent / "medusa" / name


def is_heads_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a heads artifact (its config and weights files)."""
    path = Path(path)
    return (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file()


class HeadsLike(Protocol):
    """What decoding needs from Medusa heads (`MedusaHeads` below, or a test double). Optional:
    a ``config`` with ``root_input`` true (then calls pass ``roots=``, see `reads_root`) and a
    ``candidates(hidden, k, top_k, roots=None)`` method returning token ids (used instead of
    top-k over the logits when present)."""

    num_heads: int

    def __call__(self, hidden: Tensor, num_heads: int | None = None) -> Tensor:  # [E] -> [K, V]
        ...


def reads_root(heads: HeadsLike) -> bool:
    """Whether ``heads`` take the root token (``heads(hidden, k, roots=...)``; `MedusaConfig.root_input`)."""
    return bool(getattr(getattr(heads, "config", None), "root_input", False))


def head_candidates(heads: HeadsLike, hidden: Tensor, num_heads: int, top_k: int, roots: Tensor) -> Tensor:
    """Each head's ``top_k`` best token ids for a proposal: hidden [..., E], roots [...] long (passed
    only to heads that read them) -> [K, ..., top_k]; the heads' own `MedusaHeads.candidates` where
    they have it (a shortlist), else top-k over their logits."""
    kwargs = {"roots": roots} if reads_root(heads) else {}
    with torch.inference_mode():
        if hasattr(heads, "candidates"):
            return heads.candidates(hidden, num_heads, top_k, **kwargs)
        return torch.topk(heads(hidden, num_heads, **kwargs), top_k, dim=-1).indices


class MedusaError(ValueError):
    """Bad Medusa heads input: wrong shapes, a missing artifact, a mismatched base model."""


@dataclass(frozen=True)
class MedusaConfig:
    """What a heads artifact is and which model it belongs to."""

    num_heads: int
    """K: number of heads; head k predicts the token k positions beyond the next one."""
    hidden_size: int
    """E: the base model's hidden size (input width of every head)."""
    vocab_size: int
    """V: the base model's vocabulary (output width of every head)."""
    num_layers: int = 1
    """Residual SiLU blocks per head."""
    shared_lm_head: bool = False
    """True: heads reuse the base model's LM head (not stored in the artifact)."""
    lm_head_bias: bool = False
    """Whether the per-head vocabulary projections have a bias (copied from the LM head)."""
    shortlist_size: int = 0
    """0: at inference the heads rank the whole vocabulary. F > 0: only the F tokens of their
    ``shortlist`` buffer (the most frequent in training, FR-Spec style): the shared LM head pass
    reads F of its V rows. Training on text uses the whole vocabulary; chat-mode training
    (`specops.train.heads.run_chat_heads_job`) ranks the shortlist only, as decoding does."""
    root_input: bool = False
    """True: the heads also read the root, the token the target chose after ``h`` (known when
    they run): their input is ``h + R e(root)``, with ``e`` the base model's input embedding
    and ``R`` [E, E] learned (zero-initialised: untrained, the heads are Medusa's)."""
    base_model: str = ""
    """Name or path of the base model the heads were made for."""
    base_model_hash: str = ""
    """:func:`model_fingerprint` of the base model."""
    head_topk_accuracy: list[list[float]] = field(default_factory=list)
    """Measured accuracy [K][k]: probability that head k's rank-r token is the true one
    (held-out data, filled in by training); used to build sparse trees."""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("num_heads", "hidden_size", "vocab_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MedusaError(f"MedusaConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.shortlist_size, int) or not 0 <= self.shortlist_size <= self.vocab_size:
            raise MedusaError(f"MedusaConfig.shortlist_size must be in 0..vocab_size ({self.vocab_size}), "
                              f"got {self.shortlist_size!r}")
        if self.head_topk_accuracy and len(self.head_topk_accuracy) != self.num_heads:
            raise MedusaError(
                f"MedusaConfig.head_topk_accuracy has {len(self.head_topk_accuracy)} rows, expected num_heads={self.num_heads}"
            )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<config>") -> MedusaConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MedusaError(f"{source}: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise MedusaError(f"{source}: expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MedusaError(f"{source}: unknown fields {unknown}")
        if data.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
            raise MedusaError(f"{source}: format_version {data['format_version']} is newer than this specops ({FORMAT_VERSION})")
        try:
            return cls(**data)
        except TypeError as exc:
            raise MedusaError(f"{source}: {exc}") from None


def model_fingerprint(model: nn.Module) -> str:
    """A cheap identity for a base model: sha256 over its config and LM-head weight.

    Hashing every weight of a multi-GB model would take seconds at each load; the
    config plus the vocabulary projection identifies a checkpoint well enough to
    warn when heads are used on a model they were not trained for.
    """
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        data = config.to_dict()
        for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
                         "_attn_implementation_autoset", "use_cache"):
            data.pop(volatile, None)
        digest.update(json.dumps(data, sort_keys=True, default=str).encode())
    weight = _lm_head(model).weight.detach()  # [V, E]
    digest.update(weight.to(torch.float32).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


def _lm_head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise MedusaError(f"{type(model).__name__} has no nn.Linear output embedding (LM head) to build Medusa heads from")
    return head


def inference_dtype(device: str | torch.device) -> torch.dtype:
    """The fastest dtype for running heads: bf16 where the CPU has native bf16 matmuls
    (4x faster than fp32 at batch 1 on AVX512-BF16) or on CUDA, else fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    mkldnn_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if device.type == "cpu" and mkldnn_bf16 is not None and mkldnn_bf16():
        return torch.bfloat16
    return torch.float32


class ResidualBlock(nn.Module):
    """``x + SiLU(W x + b)`` with ``W`` zero-initialised, so it starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:  # [..., E] -> [..., E]
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads over a base model's last hidden state (see the module docstring)."""

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        e, v = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResidualBlock(e) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        self._shared: nn.Linear | None = None
        self._embed: Tensor | None = None  # the base model's input embedding [V, E] (root_input heads)
        if config.shortlist_size:  # token ids the heads rank at inference (`candidates`)
            self.register_buffer("shortlist", torch.arange(config.shortlist_size, dtype=torch.long))
        else:
            self.shortlist = None
        # R of `MedusaConfig.root_input`: zero at first, so untrained root input changes nothing
        self.root_proj = nn.Linear(e, e, bias=False) if config.root_input else None
        if self.root_proj is not None:
            nn.init.zeros_(self.root_proj.weight)
        if config.shared_lm_head:
            self.lm_heads = None
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(e, v, bias=config.lm_head_bias) for _ in range(config.num_heads))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model(cls, target: nn.Module, num_heads: int, *, num_layers: int = 1,
                   shared_lm_head: bool = False, root_input: bool = False) -> MedusaHeads:
        """Untrained heads for a transformers causal LM: blocks at identity, LM head copied."""
        if not isinstance(num_heads, int) or num_heads < 1:
            raise MedusaError(f"num_heads must be a positive int, got {num_heads!r}")
        head = _lm_head(target)
        vocab, hidden = head.weight.shape
        config = MedusaConfig(
            num_heads=num_heads, hidden_size=hidden, vocab_size=vocab, num_layers=num_layers,
            shared_lm_head=shared_lm_head, lm_head_bias=head.bias is not None, root_input=root_input,
            base_model=str(getattr(getattr(target, "config", None), "_name_or_path", "") or type(target).__name__),
            base_model_hash=model_fingerprint(target),
        )
        heads = cls(config)
        if shared_lm_head or root_input:
            heads.bind(target)
        if not shared_lm_head:
            with torch.no_grad():
                for lm in heads.lm_heads:
                    lm.weight.copy_(head.weight)
                    if head.bias is not None:
                        lm.bias.copy_(head.bias)
        return heads.to(device=head.weight.device, dtype=head.weight.dtype)

    def bind(self, target: nn.Module) -> MedusaHeads:
        """Check the heads fit ``target``; shared-LM-head heads start using its LM head."""
        head = _lm_head(target)
        vocab, hidden = head.weight.shape
        if (vocab, hidden) != (self.config.vocab_size, self.config.hidden_size):
            raise MedusaError(
                f"heads expect hidden={self.config.hidden_size}, vocab={self.config.vocab_size}; "
                f"the base model has hidden={hidden}, vocab={vocab}"
            )
        if self.config.base_model_hash and self.config.base_model_hash != model_fingerprint(target):
            logger.warning("Medusa heads were trained for base model %r (hash %s), not this one: output stays exact, "
                           "acceptance may be poor", self.config.base_model, self.config.base_model_hash)
        if self.config.shared_lm_head:
            # A plain attribute, not a submodule: the base model's weights are not ours to save or
            # train. A copy in the heads' own dtype when that differs (bf16 heads, fp32 base).
            dtype = self.blocks[0][0].linear.weight.dtype
            if head.weight.dtype != dtype:
                copy = nn.Linear(hidden, vocab, bias=head.bias is not None, device=head.weight.device, dtype=dtype)
                with torch.no_grad():
                    copy.weight.copy_(head.weight)
                    if head.bias is not None:
                        copy.bias.copy_(head.bias)
                head = copy.requires_grad_(False)
            object.__setattr__(self, "_shared", head)
            # the base model's own fp32 LM head, for the CPU kernel path (`_kernel_logits`)
            original = _lm_head(target)
            object.__setattr__(self, "_shared_fp32", original if original.weight.dtype == torch.float32 else None)
        if self.config.root_input:
            embed = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
            weight = getattr(embed, "weight", None)
            if not isinstance(weight, Tensor) or tuple(weight.shape) != (vocab, hidden):
                raise MedusaError(f"these heads read the root token through the base model's input embedding; "
                                  f"{type(target).__name__} has no [{vocab}, {hidden}] one")
            object.__setattr__(self, "_embed", weight.detach())  # not ours to save or train
        return self

    @classmethod
    def from_pretrained(cls, path: str | Path, *, base: nn.Module | None = None,
                        dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> MedusaHeads:
        """Load heads saved by :meth:`save_pretrained`; ``base`` is bound when given.

        ``dtype`` None picks :func:`inference_dtype` for ``device``: the heads only propose
        candidates, so their precision changes speed and acceptance, never the output.
        """
        from safetensors.torch import load_file

        path = Path(path)
        config_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not config_path.is_file() or not weights_path.is_file():
            raise MedusaError(f"{path} is not a Medusa heads directory (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
        config = MedusaConfig.from_json(config_path.read_text(), source=str(config_path))
        heads = cls(config)
        state = load_file(str(weights_path))
        expected = set(heads.state_dict())
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise MedusaError(f"{weights_path}: tensors do not match the config (missing {missing}, unexpected {extra})")
        for name, tensor in heads.state_dict().items():
            if state[name].shape != tensor.shape:
                raise MedusaError(f"{weights_path}: {name} has shape {tuple(state[name].shape)}, expected {tuple(tensor.shape)}")
        heads.load_state_dict({k: t.to(torch.float32) if t.is_floating_point() else t for k, t in state.items()})
        heads = heads.to(device=device, dtype=dtype or inference_dtype(device))
        if base is not None:
            heads.bind(base)
        return heads

    def save_pretrained(self, path: str | Path, *, dtype: torch.dtype = torch.float16) -> Path:
        """Write ``medusa_config.json`` + ``medusa_heads.safetensors`` (``dtype``) into ``path``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
                 for k, t in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt", "specops": "medusa"})
        (path / CONFIG_NAME).write_text(self.config.to_json() + "\n")
        return path

    def set_shortlist(self, tokens: Tensor | None) -> None:
        """Rank only ``tokens`` (distinct ids, e.g. the most frequent in training) at inference;
        None: the whole vocabulary again."""
        if tokens is not None:
            tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
            v = self.config.vocab_size
            if (tokens.numel() < 1 or int(tokens.min()) < 0 or int(tokens.max()) >= v
                    or tokens.unique().numel() != tokens.numel()):
                raise MedusaError(f"a shortlist must be distinct token ids in 0..{v - 1}")
        self._buffers.pop("shortlist", None)
        self.__dict__.pop("shortlist", None)
        if tokens is None:
            self.shortlist = None
            self.config = dataclasses.replace(self.config, shortlist_size=0)
            return
        device = self.blocks[0][0].linear.weight.device
        self.register_buffer("shortlist", tokens.to(device))
        self.config = dataclasses.replace(self.config, shortlist_size=tokens.numel())

    def with_accuracy(self, accuracy: list[list[float]]) -> None:
        """Record measured per-head top-k accuracy [K][k] in the config."""
        self.config = dataclasses.replace(self.config, head_topk_accuracy=[[float(a) for a in row] for row in accuracy])

    # ------------------------------------------------------------------ compute
    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def features(self, hidden: Tensor, num_heads: int | None = None, roots: Tensor | None = None) -> Tensor:
        """Residual-block outputs. hidden: [..., E] (roots: [...] long, root_input heads) -> [K, ..., E]."""
        k = self._check(hidden, num_heads, roots)
        hidden = hidden.to(self.blocks[0][0].linear.weight.dtype)
        if self.root_proj is not None:
            hidden = hidden + self.root_proj(self._root_embedding(roots).to(hidden.dtype))
        return torch.stack([self.blocks[i](hidden) for i in range(k)])

    def _root_embedding(self, roots: Tensor) -> Tensor:  # [...] long -> [..., E]
        if self._embed is None:
            raise MedusaError("these heads read the root token through the base model's embedding: bind(target) them first")
        return F.embedding(roots.to(self._embed.device), self._embed)

    def forward(self, hidden: Tensor, num_heads: int | None = None, roots: Tensor | None = None) -> Tensor:
        """Head logits. hidden: [..., E] -> [K, ..., V] (head i predicts x_{t+i+2}). ``roots`` [...]
        long: the token the target chose after each hidden state; required by root_input heads
        (`MedusaConfig.root_input`), rejected by the others."""
        if not torch.is_grad_enabled():
            k = self._check(hidden, num_heads, roots)
            if self._kernel_path(hidden, k):
                return self._kernel_logits(hidden, k, roots)
        z = self.features(hidden, num_heads, roots)  # [K, ..., E]
        if self.config.shared_lm_head:
            if self._shared is None:
                raise MedusaError("these heads share the base model's LM head: bind(target) them first")
            return self._shared(z.to(self._shared.weight.dtype))  # [K, ..., V] one matmul for all heads
        return torch.stack([self.lm_heads[i](z[i]) for i in range(z.shape[0])])

    def logits_over(self, hidden: Tensor, tokens: Tensor, num_heads: int | None = None,
                    roots: Tensor | None = None) -> Tensor:
        """Head logits over ``tokens`` [F] (distinct ids) only: hidden [..., E] -> [K, ..., F], with
        gradients: training over a shortlist reads F rows of the LM head instead of V."""
        z = self.features(hidden, num_heads, roots)  # [K, ..., E]
        tokens = tokens.to(z.device)
        if self.config.shared_lm_head:
            if self._shared is None:
                raise MedusaError("these heads share the base model's LM head: bind(target) them first")
            weight = self._shared.weight[tokens]
            bias = None if self._shared.bias is None else self._shared.bias[tokens]
            return F.linear(z.to(weight.dtype), weight, bias)  # one matmul for all heads
        return torch.stack([F.linear(z[i], lm.weight[tokens], None if lm.bias is None else lm.bias[tokens])
                            for i, lm in enumerate(self.lm_heads[: z.shape[0]])])

    def candidates(self, hidden: Tensor, num_heads: int, top_k: int, roots: Tensor | None = None) -> Tensor:
        """Each head's ``top_k`` best token ids, best first: hidden [..., E] -> [K, ..., top_k] long.
        What a proposal needs (inference only): with a shortlist only its tokens are ranked, and
        the LM head pass reads only their rows."""
        with torch.inference_mode():
            return self._candidates(hidden, num_heads, top_k, roots)

    def _candidates(self, hidden: Tensor, num_heads: int, top_k: int, roots: Tensor | None) -> Tensor:
        k = self._check(hidden, num_heads, roots)
        shortlisted = self.shortlist is not None and top_k <= self.shortlist.numel()
        if self._kernel_path(hidden, k) and top_k <= (self.shortlist.numel() if shortlisted else self.config.vocab_size):
            # the whole proposal in one C call (`cpu_linear.medusa_candidates`)
            lead, e = hidden.shape[:-1], hidden.shape[-1]
            weights = self._kernel_blocks[4 if shortlisted else 5]
            ids = cpu_linear.medusa_candidates(weights, hidden.reshape(-1, e).contiguous(), k, top_k,
                                               None if roots is None else roots.reshape(-1))  # [K, R, top_k]
            return ids.view(k, *lead, top_k)
        if not shortlisted:
            return torch.topk(self(hidden, num_heads, roots), top_k, dim=-1).indices
        z = self.features(hidden, num_heads, roots)  # [K, ..., E]
        if self.config.shared_lm_head:
            if self._shared is None:
                raise MedusaError("these heads share the base model's LM head: bind(target) them first")
            weight, bias = self._shortlisted(self._shared)
            logits = F.linear(z.to(weight.dtype), weight, bias)
        else:
            logits = torch.stack([F.linear(z[i], *self._shortlisted(lm)) for i, lm in enumerate(self.lm_heads[:k])])
        return self.shortlist[torch.topk(logits, top_k, dim=-1).indices]

    def kernel_weights(self, num_heads: int, top_k: int) -> cpu_linear.MedusaWeights | None:
        """The weights `candidates` hands the C kernel for ``num_heads`` heads' top ``top_k`` of
        one fp32 CPU row (over the shortlist when ``top_k`` fits in it), for callers that run
        the kernel themselves (`cpu_linear.StepLoop`); None where `candidates` would not use it."""
        probe = torch.empty(1, self.config.hidden_size)
        if not 1 <= num_heads <= self.config.num_heads or not self._kernel_path(probe, num_heads):
            return None
        shortlisted = self.shortlist is not None and top_k <= self.shortlist.numel()
        if not 1 <= top_k <= (self.shortlist.numel() if shortlisted else self.config.vocab_size):
            return None
        return self._kernel_blocks[4 if shortlisted else 5]

    def _shortlisted(self, head: nn.Linear) -> tuple[Tensor, Tensor | None]:
        """The shortlist's rows of an LM head's weight [F, E] and bias, gathered once per weights."""
        key = (head.weight.data_ptr(), head.weight._version, self.shortlist.data_ptr())
        cache = self.__dict__.setdefault("_shortlist_rows", {})
        hit = cache.get(id(head))
        if hit is None or hit[0] != key:
            rows = self.shortlist.to(head.weight.device)
            hit = (key, head.weight.detach()[rows].contiguous(), None if head.bias is None else head.bias.detach()[rows])
            cache[id(head)] = hit
        return hit[1], hit[2]

    def _kernel_path(self, hidden: Tensor, k: int) -> bool:
        """Whether inference on ``hidden`` runs on the C kernel: fp32 CPU rows, shared LM head, at
        most KERNEL_MAX_ROWS heads x rows, and the kernel ready (`_kernel_ready`)."""
        return (hidden.device.type == "cpu" and hidden.dtype == torch.float32 and self.config.shared_lm_head
                and k * max(1, hidden.numel() // hidden.shape[-1]) <= KERNEL_MAX_ROWS and self._kernel_ready())

    def _kernel_ready(self) -> bool:
        """Whether `_kernel_logits` can run: the C kernels are built and the heads share an fp32
        base LM head. Their fp32 copies of the blocks are made here (again after the weights change)."""
        shared = getattr(self, "_shared_fp32", None)
        if shared is None or not shared.weight.is_contiguous() or not cpu_linear.available():
            return False
        if self.root_proj is not None and (self._embed is None or self._embed.dtype != torch.float32):
            return False
        params = getattr(self, "_kernel_params", None)
        if params is None:
            params = [p for block in self.blocks for p in block.parameters()]
            if self.root_proj is not None:
                params.append(self.root_proj.weight)
            object.__setattr__(self, "_kernel_params", params)
        key = (tuple((p.data_ptr(), p._version) for p in params), shared.weight.data_ptr(), shared.weight._version,
               None if self.shortlist is None else self.shortlist.data_ptr(),
               None if self._embed is None else self._embed.data_ptr())
        cached = getattr(self, "_kernel_blocks", None)
        if cached is None or cached[0] != key:
            # bfloat16 weights where the kernel reads them (widened to fp32 in registers): the heads only
            # propose tokens, so output stays exact, and a proposal reads half the bytes (the shared LM
            # head is 4 MB in fp32 on the bundled target, read again after every target forward evicted
            # it). Bundled heads, code suite, fixed trees: tokens per forward unchanged (2.476 / 2.756 /
            # 2.899 / 3.048 fp32 against 2.478 / 2.756 / 2.902 / 3.051 for chain / small / medium / large)
            dtype = torch.bfloat16 if cpu_linear.bf16_weights() else torch.float32
            pack = cpu_linear.pack  # the kernel's panel layout
            weights = [[(pack(b.linear.weight.detach().to(dtype)), b.linear.bias.detach().float().contiguous())
                        for b in blocks] for blocks in self.blocks]
            lm = pack(shared.weight.detach().to(dtype))
            root = None if self.root_proj is None else pack(self.root_proj.weight.detach().to(dtype))
            short = None
            if self.shortlist is not None:  # the shortlisted rows of the LM head (and bias), in shortlist order
                rows = self.shortlist.to(shared.weight.device)
                short = (pack(shared.weight.detach()[rows].to(dtype)),
                         None if shared.bias is None else shared.bias.detach()[rows].float().contiguous())
            # the same weights for `cpu_linear.medusa_candidates`: over the whole vocabulary, and over the shortlist
            embed = None if root is None else self._embed.contiguous()
            lm_bias = None if shared.bias is None else shared.bias.detach().float().contiguous()
            full = cpu_linear.MedusaWeights(weights, lm, lm_bias, None, root, embed)
            listed = full if short is None else cpu_linear.MedusaWeights(
                weights, short[0], short[1], self.shortlist.to(torch.long).contiguous(), root, embed)
            # (key, per-head blocks, packed LM head, packed root projection, MedusaWeights over the
            # shortlist, MedusaWeights over the vocabulary)
            object.__setattr__(self, "_kernel_blocks", (key, weights, lm, root, listed, full))
        return True

    def _kernel_logits(self, hidden: Tensor, k: int, roots: Tensor | None = None) -> Tensor:  # [..., E] -> [K, ..., V]
        """The heads on the C linear kernel (fp32 math; bf16 weights where it reads them, see
        `_kernel_ready`): at batch 1 a proposal is 2 small matrices per
        head and one pass of the shared LM head over the K features. Runs on the caller's
        thread and the kernel's own pool, so torch's OpenMP workers stay asleep between the
        target's C forwards (they spun and took the second core from them: Medusa decoding
        measured 422 tok/s with the heads in torch bf16 against 620 with the workers told not
        to spin)."""
        lead, e = hidden.shape[:-1], hidden.shape[-1]
        x = hidden.reshape(-1, e).contiguous()  # [R, E]
        if self.root_proj is not None:  # x + R e(root), the add fused into the kernel
            emb = self._root_embedding(roots.reshape(-1)).contiguous()  # [R, E]
            x = cpu_linear.unchecked(emb, self._kernel_blocks[3], None, x, None, None, 0.0, False)
        feats = []
        for blocks in self._kernel_blocks[1][:k]:
            z = x
            for weight, bias in blocks:
                y = cpu_linear.unchecked(z, weight, bias, None, None, None, 0.0, False)  # [R, E]
                z = z + F.silu(y)
            feats.append(z)
        z = torch.cat(feats).contiguous()  # [K*R, E]
        shared = self._shared_fp32
        weight, bias = self._kernel_blocks[2], None if shared.bias is None else shared.bias.detach()
        logits = cpu_linear.unchecked(z, weight, bias, None, None, None, 0.0, False)  # [K*R, V or F]
        return logits.view(k, *lead, -1)

    def _check(self, hidden: Tensor, num_heads: int | None, roots: Tensor | None = None) -> int:
        if hidden.shape[-1] != self.config.hidden_size:
            raise MedusaError(f"hidden state width {hidden.shape[-1]} != heads' hidden_size {self.config.hidden_size}")
        if self.config.root_input:
            if roots is None:
                raise MedusaError("these heads read the root token (root_input): pass roots=")
            if tuple(roots.shape) != tuple(hidden.shape[:-1]) or roots.dtype != torch.long:
                raise MedusaError(f"roots must be long {tuple(hidden.shape[:-1])} (one per hidden state), "
                                  f"got {roots.dtype} {tuple(roots.shape)}")
        elif roots is not None:
            raise MedusaError("these heads do not read the root token (root_input is off): pass no roots")
        k = self.config.num_heads if num_heads is None else num_heads
        if not 1 <= k <= self.config.num_heads:
            raise MedusaError(f"heads={k} out of range: these Medusa heads have 1..{self.config.num_heads}")
        return k
