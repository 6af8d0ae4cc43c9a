"""Training Medusa heads on a frozen base model.

The base model never changes (its parameters are frozen and it runs under
``no_grad``); only the heads learn. For a sequence ``x`` with base hidden states
``h_t`` (after the final norm), head ``k`` (1-based) at position ``t`` is trained to
predict ``x_{t+k+1}``:

* data mode: cross-entropy against the text's own tokens;
* self-distillation (``self_distill=True``): the sequences are the base model's own
  greedy continuations of prompts cut from the text, and only the generated part is
  a target, so head ``k`` at ``t`` learns the base model's own greedy token at
  ``t+k+1``: exactly what greedy decoding will accept. Any model can get heads this
  way without its original training data. The frozen base's hidden states for the
  generated pool are computed once, so a step costs only the heads' forward/backward.

Head ``k``'s loss is weighted by ``head_decay ** (k-1)`` (later heads are harder and
matter less, since a tree reaches them less often). After training, every head's
per-rank accuracy is measured on held-out data against the base model's greedy
continuations (what greedy decoding accepts); this table goes into the heads' config
and drives the sparse-tree builder. Top-1/top-5 on held-out *text* are reported too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specops.decoder.medusa_heads import MedusaHeads, reads_root

logger = logging.getLogger(__name__)

IGNORE = -100  # label of positions that are not training targets


@dataclass
class HeadsTrainConfig:
    """One heads training run."""

    num_heads: int = 3
    """K heads to train."""
    num_layers: int = 1
    """Residual blocks per head."""
    shared_lm_head: bool = False
    """Reuse the base model's LM head in every head (train only the residual blocks)."""
    root_input: bool = False
    """Heads that also read the root token (`MedusaConfig.root_input`)."""
    shortlist: int = 0
    """F > 0: the saved heads rank only the F most frequent tokens of the training text at
    inference (`MedusaConfig.shortlist_size`); 0: the whole vocabulary."""
    self_distill: bool = False
    """Train on the base model's own greedy continuations (no original data needed)."""
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    """Tokens per training sequence (self-distill: prompt + generated continuation)."""
    distill_prompt_len: int = 32
    """Self-distill: prompt tokens cut from the data before the greedy continuation."""
    distill_sequences: int = 256
    """Self-distill: how many continuations to generate (sampled from during training)."""
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    head_decay: float = 0.8
    grad_clip: float = 1.0
    eval_batches: int = 4
    eval_rank_k: int = 8
    """Ranks per head in the measured accuracy table."""
    seed: int = 0
    progress: bool = True

    def validate(self) -> None:
        for name in ("num_heads", "num_layers", "steps", "batch_size", "seq_len", "distill_sequences",
                     "eval_batches", "eval_rank_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.seq_len < self.num_heads + 3:
            raise ValueError(f"seq_len {self.seq_len} too short for {self.num_heads} heads (needs >= heads + 3)")
        if self.self_distill and not 1 <= self.distill_prompt_len < self.seq_len:
            raise ValueError(f"distill_prompt_len must be in [1, seq_len), got {self.distill_prompt_len}")
        if not isinstance(self.shortlist, int) or self.shortlist < 0:
            raise ValueError(f"shortlist must be an int >= 0, got {self.shortlist!r}")
        if self.lr <= 0 or not 0 < self.head_decay <= 1:
            raise ValueError(f"need lr > 0 and 0 < head_decay <= 1, got lr={self.lr}, head_decay={self.head_decay}")


@dataclass
class HeadsReport:
    """What a run did and how good the heads are (accuracies in [0, 1])."""

    steps: int
    wall_s: float
    losses: list[float] = field(default_factory=list)
    text_top1: list[float] = field(default_factory=list)
    """Per head: top-1 accuracy on held-out text (data tokens)."""
    text_top5: list[float] = field(default_factory=list)
    greedy_top1: list[float] = field(default_factory=list)
    """Per head: top-1 accuracy against the base model's greedy continuations of held-out prompts."""
    greedy_top5: list[float] = field(default_factory=list)
    rank_accuracy: list[list[float]] = field(default_factory=list)
    """[K][eval_rank_k]: P(the greedy token is head k's rank r), held-out."""

    def to_dict(self) -> dict:
        return {
            "steps": self.steps, "wall_s": round(self.wall_s, 1),
            "final_loss": round(sum(self.losses[-10:]) / max(1, len(self.losses[-10:])), 4),
            "text_top1": [round(a, 4) for a in self.text_top1], "text_top5": [round(a, 4) for a in self.text_top5],
            "greedy_top1": [round(a, 4) for a in self.greedy_top1],
            "greedy_top5": [round(a, 4) for a in self.greedy_top5],
        }


def base_hidden(base, ids: torch.Tensor) -> torch.Tensor:
    """Frozen base pass. ids: [B, T] -> hidden [B, T, E] (last hidden state, after the final norm)."""
    with torch.no_grad():
        out = base(input_ids=ids, output_hidden_states=True, use_cache=False, return_dict=True)
    return out.hidden_states[-1].detach()


def greedy_continuations(base, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Base model's greedy continuation of each prompt. prompts: [B, P] -> [B, P + new_tokens]."""
    from transformers import DynamicCache

    from specops.decoder.hf_runner import cache_argument

    seq = prompts
    cache = {cache_argument(base): DynamicCache(config=base.config)}  # `cache=` or, before 5.2x, `past_key_values=`
    with torch.no_grad():
        out = base(input_ids=prompts, use_cache=True, return_dict=True, **cache)
        for _ in range(new_tokens):
            nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
            seq = torch.cat([seq, nxt], dim=1)
            out = base(input_ids=nxt, use_cache=True, return_dict=True, **cache)
    return seq


def head_logits(heads: MedusaHeads, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Every head at every position but the last: [K, B, T-1, V]. hidden: [B, T, E];
    tokens: [B, T] the sequence (root_input heads read x_{t+1}, the root, at position t)."""
    if reads_root(heads):
        return heads(hidden[:, :-1], roots=tokens[:, 1:])
    return heads(hidden[:, :-1])


def heads_loss(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, decay: float,
               tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum over heads of the cross-entropy of head k (1-based) at t against token t+k+1.

    hidden: [B, T, E]. targets: [B, T] long token ids; IGNORE marks positions that are
    no target (the prompt part of a self-distilled sequence). tokens: [B, T] the sequence
    itself (default ``targets``; needed where targets has IGNOREs and the heads read the root).
    """
    t = hidden.shape[1]
    total = hidden.new_zeros((), dtype=torch.float32)
    logits = head_logits(heads, hidden, targets if tokens is None else tokens)  # [K, B, T-1, V]
    for k in range(heads.num_heads):
        shift = k + 2  # head k (0-based) at t predicts x_{t+k+2}
        if t <= shift:
            continue
        pred = logits[k, :, : t - shift].float()  # [B, T - shift, V]
        labels = targets[:, shift:]  # [B, T - shift]
        if bool((labels == IGNORE).all()):
            continue
        loss = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)
        total = total + decay**k * loss
    return total


def rank_counts(heads: MedusaHeads, hidden: torch.Tensor, tokens: torch.Tensor, rank_k: int,
                start: int = 0) -> torch.Tensor:
    """counts [K, rank_k + 1]: how often the true token x_{t+k+2} was head k's rank r (last column:
    outside the top rank_k); positions t >= start only. hidden: [B, T, E]; tokens: [B, T]."""
    k_heads = heads.num_heads
    counts = torch.zeros(k_heads, rank_k + 1, dtype=torch.long)
    t = hidden.shape[1]
    with torch.no_grad():
        logits = head_logits(heads, hidden, tokens)  # [K, B, T-1, V]
        for k in range(k_heads):
            shift = k + 2
            if t - shift <= start:
                continue
            top = torch.topk(logits[k, :, start : t - shift], rank_k, dim=-1).indices  # [B, T', r]
            truth = tokens[:, start + shift :]  # [B, T']
            hit = top == truth[..., None]  # [B, T', r]
            counts[k, :rank_k] += hit.sum(dim=(0, 1))
            counts[k, rank_k] += int((~hit.any(-1)).sum())
    return counts


def _accuracies(counts: torch.Tensor) -> tuple[list[list[float]], list[float], list[float]]:
    total = counts.sum(-1, keepdim=True).clamp_min(1).double()  # [K, 1]
    ranks = (counts[:, :-1].double() / total)  # [K, r]
    return ranks.tolist(), ranks[:, 0].tolist(), ranks[:, :5].sum(-1).tolist()


def evaluate_heads(base, heads: MedusaHeads, heldout: torch.Tensor, cfg: HeadsTrainConfig) -> HeadsReport:
    """Held-out accuracy. heldout: [M, seq_len] windows of text tokens."""
    heads.eval()
    text = torch.zeros(heads.num_heads, cfg.eval_rank_k + 1, dtype=torch.long)
    greedy = torch.zeros_like(text)
    prompt_len = max(1, min(cfg.distill_prompt_len, cfg.seq_len // 4))
    for i in range(0, min(len(heldout), cfg.eval_batches * cfg.batch_size), cfg.batch_size):
        batch = heldout[i : i + cfg.batch_size]  # [b, T]
        hidden = base_hidden(base, batch)
        text += rank_counts(heads, hidden, batch, cfg.eval_rank_k)
        seq = greedy_continuations(base, batch[:, :prompt_len], cfg.seq_len - prompt_len)  # [b, T]
        hidden = base_hidden(base, seq)
        greedy += rank_counts(heads, hidden, seq, cfg.eval_rank_k, start=prompt_len - 1)
    report = HeadsReport(steps=0, wall_s=0.0)
    _, report.text_top1, report.text_top5 = _accuracies(text)
    report.rank_accuracy, report.greedy_top1, report.greedy_top5 = _accuracies(greedy)
    return report


def frequency_shortlist(stream: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``stream`` [N], most frequent first (ties: lower id)."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"shortlist size must be in 1..{vocab_size} (the vocabulary), got {size}")
    counts = torch.bincount(stream.flatten().long(), minlength=vocab_size)[:vocab_size]  # [V]
    return torch.sort(counts, descending=True, stable=True).indices[:size]


def _lr(step: int, cfg: HeadsTrainConfig) -> float:
    warm = min(cfg.warmup_steps, max(1, cfg.steps // 10))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@dataclass
class DistillPool:
    """Greedy continuations of the base model with its hidden states, computed once."""

    tokens: torch.Tensor  # [S, T] long: prompt + greedy continuation
    labels: torch.Tensor  # [S, T] long: tokens, IGNORE over the prompt
    hidden: torch.Tensor  # [S, T, E] base hidden states (after the final norm)


def greedy_rows(base, stream: torch.Tensor, *, sequences: int, prompt_len: int, length: int, batch_size: int,
                gen: torch.Generator, progress: bool = True) -> torch.Tensor:
    """``sequences`` rows of ``length`` tokens, generated ``batch_size`` at a time: a random
    ``prompt_len``-token prompt cut from ``stream`` [N], then the base model's greedy
    continuation. -> [S, length]. Shared by the heads' and the draft's self-distillation."""
    high = stream.numel() - prompt_len
    if high <= 0:
        raise ValueError(f"training text has {stream.numel()} tokens, fewer than the prompt length {prompt_len}")
    rows = []
    with tqdm(total=sequences, desc="self-distill: generating", disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, sequences, batch_size):
            n = min(batch_size, sequences - start)
            starts = torch.randint(0, high, (n,), generator=gen)                      # [n]
            prompts = stream[starts[:, None] + torch.arange(prompt_len)[None]]          # [n, P]
            rows.append(greedy_continuations(base, prompts, length - prompt_len))      # [n, length]
            bar.update(n)
    return torch.cat(rows)


def distill_pool(base, stream: torch.Tensor, cfg: HeadsTrainConfig, gen: torch.Generator) -> DistillPool:
    """``cfg.distill_sequences`` greedy continuations of random prompts cut from ``stream`` [N]."""
    tokens = greedy_rows(base, stream, sequences=cfg.distill_sequences, prompt_len=cfg.distill_prompt_len,
                         length=cfg.seq_len, batch_size=cfg.batch_size, gen=gen, progress=cfg.progress)
    hidden = [base_hidden(base, tokens[i:i + cfg.batch_size]) for i in range(0, tokens.shape[0], cfg.batch_size)]
    labels = tokens.clone()
    labels[:, : cfg.distill_prompt_len] = IGNORE
    return DistillPool(tokens=tokens, labels=labels, hidden=torch.cat(hidden))


def train_heads(base, heads: MedusaHeads, stream: torch.Tensor, heldout: torch.Tensor,
                cfg: HeadsTrainConfig) -> HeadsReport:
    """Train ``heads`` on a frozen ``base``. stream: [N] training tokens; heldout: [M, seq_len].

    Records the measured rank-accuracy table in ``heads.config`` and returns the report.
    """
    cfg.validate()
    if stream.dim() != 1 or stream.numel() <= cfg.seq_len + 1:
        raise ValueError(f"training stream must be 1-D with more than seq_len+1={cfg.seq_len + 1} tokens, "
                         f"got shape {tuple(stream.shape)}")
    if heldout.dim() != 2 or heldout.shape[0] == 0:
        raise ValueError(f"heldout must be [M, seq_len] windows, got shape {tuple(heldout.shape)}")
    base.eval()
    for p in base.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.seed)
    start_time = time.perf_counter()
    pool = distill_pool(base, stream, cfg, gen) if cfg.self_distill else None
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    heads.train()
    report = HeadsReport(steps=cfg.steps, wall_s=0.0)
    bar = tqdm(range(cfg.steps), desc="medusa heads", disable=not cfg.progress)
    for step in bar:
        if pool is not None:
            idx = torch.randint(0, pool.tokens.shape[0], (cfg.batch_size,), generator=gen)  # [B]
            hidden, targets, tokens = pool.hidden[idx], pool.labels[idx], pool.tokens[idx]  # [B, T, E], [B, T], [B, T]
        else:
            starts = torch.randint(0, stream.numel() - cfg.seq_len, (cfg.batch_size,), generator=gen)
            targets = tokens = stream[starts[:, None] + torch.arange(cfg.seq_len)[None]]  # [B, T]
            hidden = base_hidden(base, targets)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, cfg)
        loss = heads_loss(heads, hidden, targets, cfg.head_decay, tokens)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        report.losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{report.losses[-1]:.3f}")
    heads.eval()
    measured = evaluate_heads(base, heads, heldout, cfg)
    report.text_top1, report.text_top5 = measured.text_top1, measured.text_top5
    report.greedy_top1, report.greedy_top5 = measured.greedy_top1, measured.greedy_top5
    report.rank_accuracy = measured.rank_accuracy
    heads.with_accuracy(measured.rank_accuracy)
    if cfg.shortlist:
        heads.set_shortlist(frequency_shortlist(stream, cfg.shortlist, heads.config.vocab_size))
    report.wall_s = time.perf_counter() - start_time
    logger.info("heads trained: %s", report.to_dict())
    return report


def continue_heads(heads: MedusaHeads, init: MedusaHeads) -> None:
    """Load ``init``'s weights into the fresh ``heads`` (same shape; a root projection ``init``
    lacks stays at zero, so the heads start out predicting exactly what ``init`` does). ``init``
    may have fewer heads: each extra head starts as a copy of ``init``'s last one (the deepest
    head is the nearest guess for the next offset; training then moves it one token on)."""
    mine, theirs = heads.config, init.config
    for name in ("num_layers", "shared_lm_head", "hidden_size", "vocab_size"):
        if getattr(mine, name) != getattr(theirs, name):
            raise ValueError(f"--init-heads has {name}={getattr(theirs, name)!r}, this run {getattr(mine, name)!r}")
    if theirs.num_heads > mine.num_heads:
        raise ValueError(f"--init-heads has {theirs.num_heads} heads, more than this run's {mine.num_heads}")
    if theirs.root_input and not mine.root_input:
        raise ValueError("--init-heads reads the root token (root_input); train with --root-input to continue it")
    # the init's shortlist is not a weight: this run's --shortlist decides the saved heads'
    state = {key: value for key, value in init.state_dict().items() if key != "shortlist"}
    last = theirs.num_heads - 1
    for extra in range(theirs.num_heads, mine.num_heads):
        for group in ("blocks", "lm_heads"):
            prefix = f"{group}.{last}."
            state.update({f"{group}.{extra}." + key[len(prefix):]: value.clone()
                          for key, value in list(state.items()) if key.startswith(prefix)})
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if unexpected or any(not key.startswith("root_proj.") for key in missing):
        raise ValueError(f"--init-heads does not fit these heads (missing {missing}, unexpected {unexpected})")


@dataclass(frozen=True)
class HeadsJob:
    """Everything ``specops train heads`` needs, validated."""

    model: Path
    data_files: tuple[Path, ...]
    out_dir: Path
    heldout_files: tuple[Path, ...] = ()
    tokenizer: Path | None = None
    threads: int = 2
    init_heads: Path | None = None
    """Continue these heads (same K, layers and LM-head sharing) instead of starting at identity;
    with ``root_input`` on heads trained without it, their blocks are kept and R starts at zero."""


def _find_tokenizer(model: Path, explicit: Path | None):
    from specops.train.tokenizer import load_tokenizer

    for folder in ([explicit] if explicit is not None else [model, model.parent]):
        if (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists():
            return load_tokenizer(folder)
    raise ValueError(f"no tokenizer in {model} or {model.parent}; pass --tokenizer DIR")


def run_heads_job(job: HeadsJob, cfg: HeadsTrainConfig) -> dict:
    """Load the base, tokenize the data, train and save heads; return the report as a dict."""
    from specops.train.checkpoint import load_causal_lm
    from specops.train.data import encode_stream, read_texts

    torch.set_num_threads(job.threads)
    torch.manual_seed(cfg.seed)
    base = load_causal_lm(job.model)
    tokenizer = _find_tokenizer(job.model, job.tokenizer)
    eos = base.config.eos_token_id if isinstance(base.config.eos_token_id, int) else tokenizer.eos_token_id
    if eos is None:
        raise ValueError("neither the model config nor the tokenizer names an EOS token")
    stream = encode_stream(read_texts(job.data_files), tokenizer, eos_id=eos)  # [N]
    if job.heldout_files:
        held = encode_stream(read_texts(job.heldout_files), tokenizer, eos_id=eos)
    else:  # the last 5% of the training text is held out
        cut = int(stream.numel() * 0.95)
        stream, held = stream[:cut], stream[cut:]
    n_windows = held.numel() // cfg.seq_len
    if n_windows < 1:
        raise ValueError(f"held-out text has {held.numel()} tokens, fewer than --seq-len {cfg.seq_len}")
    heldout = held[: n_windows * cfg.seq_len].view(n_windows, cfg.seq_len)  # [M, T]
    heldout = heldout[torch.randperm(n_windows, generator=torch.Generator().manual_seed(cfg.seed))]
    heads = MedusaHeads.from_model(base, num_heads=cfg.num_heads, num_layers=cfg.num_layers,
                                   shared_lm_head=cfg.shared_lm_head, root_input=cfg.root_input)
    if cfg.shortlist > heads.config.vocab_size:
        raise ValueError(f"--shortlist {cfg.shortlist} exceeds the vocabulary ({heads.config.vocab_size} tokens)")
    if job.init_heads is not None:
        continue_heads(heads, MedusaHeads.from_pretrained(job.init_heads, base=base, dtype=torch.float32))
    heads.config = dataclasses.replace(heads.config, base_model=str(job.model))
    report = train_heads(base, heads, stream, heldout, cfg)
    heads.save_pretrained(job.out_dir)
    result = {"out": str(job.out_dir), "heads": cfg.num_heads, "self_distill": cfg.self_distill,
              "train_tokens": int(stream.numel()), "heldout_windows": int(heldout.shape[0]), **report.to_dict()}
    (job.out_dir / "train_report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
