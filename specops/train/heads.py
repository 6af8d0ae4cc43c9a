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
* chat mode (`run_chat_heads_job`, ``specops train heads --chat``): the sequences are the
  target's own replies to chat prompts (the chat-model suites' prompts rendered with its chat
  template, and user messages it writes itself), written by the serving engine
  (`specops.train.self_distill`); one teacher-forced forward per reply gives its hidden states
  and the target's greedy choice after every position, so head ``k`` at a reply position ``t``
  (from the last prompt token on) learns the target's greedy token at ``t+k+1`` given the text
  so far, also on the sampled replies. Prompt positions are never targets. The benchmark's
  first prompts of each class are held out (`specops.train.eagle.prompt_texts`) and measured.

Head ``k``'s loss is weighted by ``head_decay ** (k-1)`` (later heads are harder and
matter less, since a tree reaches them less often); every mode runs the same optimizer loop
(`fit_heads`). After training, every head's per-rank accuracy is measured on held-out data
against the base model's greedy continuations (what greedy decoding accepts); this table
goes into the heads' config and drives the sparse-tree builder. Top-1/top-5 on held-out
*text* are reported too (text modes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specops.models.medusa_heads import CONFIG_NAME, WEIGHTS_NAME, MedusaHeads, inference_dtype, reads_root

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
    steps: int | None = 300
    """Optimizer steps; None: until the time budget is spent (chat mode)."""
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
            if name == "steps" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
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

    from specops.models.hf_runner import cache_argument

    seq = prompts
    cache = {cache_argument(base): DynamicCache(config=base.config)}  # `cache=` or, before 5.2x, `past_key_values=`
    with torch.no_grad():
        out = base(input_ids=prompts, use_cache=True, return_dict=True, **cache)
        for _ in range(new_tokens):
            nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
            seq = torch.cat([seq, nxt], dim=1)
            out = base(input_ids=nxt, use_cache=True, return_dict=True, **cache)
    return seq


def head_logits(heads: MedusaHeads, hidden: torch.Tensor, tokens: torch.Tensor,
                vocab: torch.Tensor | None = None) -> torch.Tensor:
    """Every head at every position but the last: [K, B, T-1, V]. hidden: [B, T, E];
    tokens: [B, T] the sequence (root_input heads read x_{t+1}, the root, at position t).
    vocab: [F] token ids: the logits over those only, [K, B, T-1, F] (`MedusaHeads.logits_over`)."""
    roots = {"roots": tokens[:, 1:]} if reads_root(heads) else {}
    if vocab is not None:
        return heads.logits_over(hidden[:, :-1], vocab, **roots)
    return heads(hidden[:, :-1], **roots)


def vocab_index(targets: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """``targets`` as indices into ``vocab`` (IGNORE where a target is not in it, or is IGNORE);
    ``targets`` itself for ``vocab`` None."""
    if vocab is None:
        return targets
    lookup = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    lookup[vocab] = torch.arange(vocab.numel())
    return torch.where(targets == IGNORE, IGNORE, lookup[targets.clamp_min(0)])


def heads_loss(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, decay: float,
               tokens: torch.Tensor | None = None, sources: torch.Tensor | None = None,
               vocab: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum over heads of the cross-entropy of head k (1-based) at t against token t+k+1.

    hidden: [B, T, E]. targets: [B, T] long token ids; IGNORE marks positions that are
    no target (the prompt part of a self-distilled sequence). tokens: [B, T] the sequence
    itself (default ``targets``; needed where targets has IGNOREs and the heads read the root).
    sources: [B, T] bool, the positions whose heads are scored (default: all; False at the
    padding between packed rows). vocab: [F] token ids: the heads rank only these (a
    shortlist), targets outside it are no target.
    """
    t = hidden.shape[1]
    total = hidden.new_zeros((), dtype=torch.float32)
    logits = head_logits(heads, hidden, targets if tokens is None else tokens, vocab)  # [K, B, T-1, V or F]
    if vocab is not None:
        targets = vocab_index(targets, vocab, heads.config.vocab_size)
    for k in range(heads.num_heads):
        shift = k + 2  # head k (0-based) at t predicts x_{t+k+2}
        if t <= shift:
            continue
        pred = logits[k, :, : t - shift].float()  # [B, T - shift, V]
        labels = targets[:, shift:]  # [B, T - shift]
        if sources is not None:
            labels = labels.masked_fill(~sources[:, : t - shift], IGNORE)
        if bool((labels == IGNORE).all()):
            continue
        loss = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)
        total = total + decay**k * loss
    return total


def rank_counts(heads: MedusaHeads, hidden: torch.Tensor, tokens: torch.Tensor, rank_k: int,
                start: int = 0, targets: torch.Tensor | None = None,
                vocab: torch.Tensor | None = None) -> torch.Tensor:
    """counts [K, rank_k + 1]: how often the true token x_{t+k+2} was head k's rank r (last column:
    outside the top rank_k); positions t >= start only. hidden: [B, T, E]; tokens: [B, T].
    targets: [B, T] the true token at each position when it is not ``tokens`` itself (the
    target's greedy choices); IGNORE marks positions that are counted nowhere. vocab: [F] token
    ids the heads rank (a shortlist; a true token outside it counts as outside the top rank_k)."""
    k_heads = heads.num_heads
    counts = torch.zeros(k_heads, rank_k + 1, dtype=torch.long)
    t = hidden.shape[1]
    with torch.no_grad():
        logits = head_logits(heads, hidden, tokens, vocab)  # [K, B, T-1, V or F]
        for k in range(k_heads):
            shift = k + 2
            if t - shift <= start:
                continue
            top = torch.topk(logits[k, :, start : t - shift], rank_k, dim=-1).indices  # [B, T', r]
            if vocab is not None:
                top = vocab[top]
            truth = (tokens if targets is None else targets)[:, start + shift :]  # [B, T']
            valid = truth != IGNORE  # [B, T']
            hit = (top == truth[..., None]) & valid[..., None]  # [B, T', r]
            counts[k, :rank_k] += hit.sum(dim=(0, 1))
            counts[k, rank_k] += int((~hit.any(-1) & valid).sum())
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


def _lr(step: int, cfg: HeadsTrainConfig, spent: float | None = None) -> float:
    """Linear warmup, then cosine to 10% of ``cfg.lr`` over the steps, or over the time budget
    (``spent``: the share of it used so far) when ``cfg.steps`` is None."""
    warm = cfg.warmup_steps if cfg.steps is None else min(cfg.warmup_steps, max(1, cfg.steps // 10))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = spent if cfg.steps is None else (step - warm) / max(1, cfg.steps - warm)
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
    if cfg.steps is None:
        raise ValueError("training on text needs a step count (steps=None is for a time budget)")
    freeze(base)
    gen = torch.Generator().manual_seed(cfg.seed)
    start_time = time.perf_counter()
    pool = distill_pool(base, stream, cfg, gen) if cfg.self_distill else None

    def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        if pool is not None:
            idx = torch.randint(0, pool.tokens.shape[0], (cfg.batch_size,), generator=gen)  # [B]
            return pool.hidden[idx], pool.labels[idx], pool.tokens[idx], None  # [B, T, E], [B, T], [B, T]
        starts = torch.randint(0, stream.numel() - cfg.seq_len, (cfg.batch_size,), generator=gen)
        tokens = stream[starts[:, None] + torch.arange(cfg.seq_len)[None]]  # [B, T]
        return base_hidden(base, tokens), tokens, tokens, None

    report = HeadsReport(steps=cfg.steps, wall_s=0.0)
    report.losses = fit_heads(heads, batch, cfg)
    measured = evaluate_heads(base, heads, heldout, cfg)
    report.text_top1, report.text_top5 = measured.text_top1, measured.text_top5
    finish_heads(heads, measured, report, stream if cfg.shortlist else None, cfg)
    report.wall_s = time.perf_counter() - start_time
    logger.info("heads trained: %s", report.to_dict())
    return report


def freeze(base) -> None:
    """The base model in eval mode with no parameter learning."""
    base.eval()
    for p in base.parameters():
        p.requires_grad_(False)


def fit_heads(heads: MedusaHeads, batch, cfg: HeadsTrainConfig, *, budget_s: float | None = None,
              bf16: bool = False, vocab: torch.Tensor | None = None, desc: str = "medusa heads") -> list[float]:
    """The optimizer loop of every mode: AdamW on the heads' parameters over ``batch()`` ->
    (hidden [B, T, E], targets [B, T], tokens [B, T], sources [B, T] or None) (as `heads_loss`
    takes them), for
    ``cfg.steps`` steps or, with ``cfg.steps`` None, until ``budget_s`` seconds have passed
    (whichever comes first when both are set); the learning rate follows `_lr`. ``bf16``: the
    forward runs under bf16 autocast (fp32 weights and loss). ``vocab``: the heads rank only
    these token ids (`heads_loss`). Returns the loss of every step; the heads are left in eval mode."""
    if cfg.steps is None and budget_s is None:
        raise ValueError("fit_heads needs cfg.steps or budget_s")
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    heads.train()
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc=desc, disable=not cfg.progress, dynamic_ncols=True)
    step = 0
    while cfg.steps is None or step < cfg.steps:
        elapsed = time.perf_counter() - start
        if budget_s is not None and step > 0 and elapsed >= budget_s:
            break
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, cfg, None if budget_s is None else elapsed / budget_s)
        hidden, targets, tokens, sources = batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = heads_loss(heads, hidden, targets, cfg.head_decay, tokens, sources, vocab)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        step += 1
        bar.update(1)
    bar.close()
    heads.eval()
    return losses


def finish_heads(heads: MedusaHeads, measured: HeadsReport, report: HeadsReport, shortlist_stream: torch.Tensor | None,
                 cfg: HeadsTrainConfig) -> None:
    """Record the held-out measurements in ``report`` and the rank-accuracy table in the heads'
    config (it drives the sparse tree); with ``cfg.shortlist`` the heads rank only the most
    frequent tokens of ``shortlist_stream`` [N] at inference."""
    report.greedy_top1, report.greedy_top5 = measured.greedy_top1, measured.greedy_top5
    report.rank_accuracy = measured.rank_accuracy
    heads.with_accuracy(measured.rank_accuracy)
    if cfg.shortlist:
        heads.set_shortlist(frequency_shortlist(shortlist_stream, cfg.shortlist, heads.config.vocab_size))


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
    model_name: str = ""
    """The registered model's name when ``model`` is its cached folder (recorded in the heads' config)."""


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
    heads = new_heads(base, cfg, job, str(job.model))
    report = train_heads(base, heads, stream, heldout, cfg)
    heads.save_pretrained(job.out_dir)
    result = {"out": str(job.out_dir), "heads": cfg.num_heads, "self_distill": cfg.self_distill,
              "train_tokens": int(stream.numel()), "heldout_windows": int(heldout.shape[0]), **report.to_dict()}
    (job.out_dir / "train_report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def new_heads(base, cfg: HeadsTrainConfig, job: HeadsJob, base_model: str) -> MedusaHeads:
    """The heads to train on ``base``: new ones of ``cfg``'s shape, or ``job.init_heads`` continued."""
    heads = MedusaHeads.from_model(base, num_heads=cfg.num_heads, num_layers=cfg.num_layers,
                                   shared_lm_head=cfg.shared_lm_head, root_input=cfg.root_input)
    if cfg.shortlist > heads.config.vocab_size:
        raise ValueError(f"--shortlist {cfg.shortlist} exceeds the vocabulary ({heads.config.vocab_size} tokens)")
    if job.init_heads is not None:
        continue_heads(heads, MedusaHeads.from_pretrained(job.init_heads, base=base, dtype=torch.float32))
    heads.config = dataclasses.replace(heads.config, base_model=base_model)
    return heads


# ---------------------------------------------------------------------- chat mode
@dataclass
class ChatData:
    """Chat mode (`run_chat_heads_job`): what the target writes for the heads to learn from, and the budget."""

    minutes: float = 20.0
    """Wall budget: the target's replies, training and the held-out report together."""
    positions: int = 400_000
    """Reply positions to collect at most."""
    self_prompts: int = 1000
    """User messages the target writes itself as extra prompts (`specops.train.self_distill.self_prompts`)."""
    max_batch: int = 64
    """Replies the serving engine writes side by side."""
    new_tokens: int = 160
    """Reply tokens per prompt at most."""
    max_prompt_tokens: int = 384
    """A longer prompt keeps its last tokens."""
    generate_share: float = 0.7
    """At most this share of the budget goes to writing and reading the replies: data is what the
    heads lack (over an 8192-token shortlist a 1024-position step of SmolLM2-135M's heads takes
    ~0.3 s on 2 cores, so the rest passes over the replies many times)."""
    eval_prompts: int = 8
    """Held-out prompts decoded with method medusa in the report (0: none)."""
    eval_new_tokens: int = 48

    def validate(self) -> None:
        if isinstance(self.minutes, bool) or not isinstance(self.minutes, (int, float)) or not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes!r}")
        for name in ("positions", "max_batch", "new_tokens", "max_prompt_tokens", "eval_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("self_prompts", "eval_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not 0 < self.generate_share < 1:
            raise ValueError(f"generate_share must be in (0, 1), got {self.generate_share!r}")


@dataclass
class ReplyRow:
    """One reply of the target as the heads train on it: the positions from the last prompt token
    to the reply's end, then one more position for the target's greedy choice after the reply."""

    tokens: torch.Tensor   # [R + 2] long: last prompt token, the R reply tokens, the greedy token after them
    hidden: torch.Tensor   # [R + 2, E] bfloat16: the target's last hidden state at each (zero at the appended one)
    targets: torch.Tensor  # [R + 2] long: the target's greedy token at each position given the text before it;
    #                        IGNORE at the prompt's last token (a prompt position)
    prompt: int = 0        # which prompt it replies to (a prompt's sampled repeats share it)


def reply_row(tokens: list[int], prompt_len: int, hidden: torch.Tensor, labels: torch.Tensor,
              prompt: int = 0) -> ReplyRow:
    """The `ReplyRow` of a sequence of ``prompt_len`` prompt tokens then a reply. hidden [L, E] and
    labels [L] as `specops.train.self_distill.teacher_forced` gives them: the state at every
    position and the target's greedy choice after it. With `heads_loss`'s shift, head k (1-based)
    at row position t learns ``targets[t + k + 1]``: the target's greedy token k + 1 positions on."""
    n = len(tokens)
    if not 1 <= prompt_len < n or hidden.shape[0] != n or labels.shape[0] != n:
        raise ValueError(f"need 1 <= prompt_len < len(tokens) and a state and label per token, got prompt_len "
                         f"{prompt_len}, {n} tokens, hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)}")
    start = prompt_len - 1
    labels = labels.long()
    return ReplyRow(
        tokens=torch.cat([torch.tensor(tokens[start:], dtype=torch.long), labels[-1:]]),
        hidden=torch.cat([hidden[start:], hidden.new_zeros(1, hidden.shape[1])]),
        targets=torch.cat([torch.tensor([IGNORE], dtype=torch.long), labels[start:]]),
        prompt=prompt,
    )


def row_batch(rows: list[ReplyRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [B, T, E] float32, targets [B, T], tokens [B, T]) for `heads_loss`: ``rows`` padded
    with IGNORE targets to the longest."""
    t = max(r.tokens.numel() for r in rows)
    b, e = len(rows), rows[0].hidden.shape[1]
    hidden = torch.zeros(b, t, e)
    targets = torch.full((b, t), IGNORE, dtype=torch.long)
    tokens = torch.zeros(b, t, dtype=torch.long)
    for i, r in enumerate(rows):
        n = r.tokens.numel()
        hidden[i, :n], targets[i, :n], tokens[i, :n] = r.hidden.float(), r.targets, r.tokens
    return hidden, targets, tokens


def packed_batch(rows: list[ReplyRow], batch_size: int, seq_len: int, num_heads: int,
                 rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [B, T, E] float32, targets [B, T], tokens [B, T], sources [B, T] bool) for
    `heads_loss` of ``num_heads`` heads: every line of ``seq_len`` positions filled with random
    rows one after another (a random window of a row longer than the room left), each followed
    by K + 1 padding positions (IGNORE targets, not sources), so no head at one row's position is
    scored on the next row's tokens and none at the padding is scored at all. Heads read one
    position at a time, so packing rows spends each step on reply positions, not on padding."""
    gap = num_heads + 1  # head k (0-based) at t is scored on t + k + 2 <= t + K + 1
    e = rows[0].hidden.shape[1]
    hidden = torch.zeros(batch_size, seq_len, e)
    targets = torch.full((batch_size, seq_len), IGNORE, dtype=torch.long)
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long)
    sources = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    for line in range(batch_size):
        at = 0
        while seq_len - at >= 2:
            r = rng.choice(rows)
            n = r.tokens.numel()
            width = min(n, seq_len - at)
            start = rng.randrange(0, n - width + 1)
            hidden[line, at : at + width] = r.hidden[start : start + width].float()
            targets[line, at : at + width] = r.targets[start : start + width]
            tokens[line, at : at + width] = r.tokens[start : start + width]
            sources[line, at : at + width] = True
            at += width + gap
    return hidden, targets, tokens, sources


def evaluate_rows(heads: MedusaHeads, rows: list[ReplyRow], cfg: HeadsTrainConfig,
                  vocab: torch.Tensor | None = None) -> HeadsReport:
    """Held-out per-rank accuracy of each head against the target's greedy tokens on reply rows
    (ranking only ``vocab``'s tokens when given, as decoding with that shortlist does)."""
    heads.eval()
    counts = torch.zeros(heads.num_heads, cfg.eval_rank_k + 1, dtype=torch.long)
    for i in range(0, len(rows), cfg.batch_size):
        hidden, targets, tokens = row_batch(rows[i : i + cfg.batch_size])
        counts += rank_counts(heads, hidden, tokens, cfg.eval_rank_k, targets=targets, vocab=vocab)
    report = HeadsReport(steps=0, wall_s=0.0)
    report.rank_accuracy, report.greedy_top1, report.greedy_top5 = _accuracies(counts)
    return report


def collect_replies(decoder, prompts: list[list[int]], data: ChatData, *, eos: int | None, budget_s: float,
                    positions: int | None, temperature: float, seed: int, desc: str, size: int | None = None,
                    progress: bool = True) -> list[ReplyRow]:
    """The target's replies to ``prompts`` (token ids, each cut to its last ``data.max_prompt_tokens``)
    as `ReplyRow`s, until ``positions`` reply positions (None: no goal) or ``budget_s`` seconds; with
    ``size``, one wave over that many prompts (the first pass: greedy). The serving engine
    writes them ``data.max_batch`` at a time (`specops.train.self_distill.ReplyWriter`: greedy first,
    then the prompts repeat sampled at ``temperature``), a wave of ``size`` prompts (default 4
    batches) at a time, each wave given at most `specops.train.eagle.WAVE_SHARE` of the time left
    so the teacher-forced forwards over what it wrote fit in the rest."""
    from specops.train.eagle import WAVE_SHARE
    from specops.train.self_distill import ReplyWriter, teacher_forced

    start = time.perf_counter()
    writer = ReplyWriter(decoder, [ids[-data.max_prompt_tokens:] for ids in prompts], new_tokens=data.new_tokens,
                         temperature=temperature, max_batch=data.max_batch, seed=seed, eos=eos)
    if size is not None:  # one pass: each prompt once (the prompts under 2 tokens the writer skips)
        size = min(size, len(writer.prompts))
    rows: list[ReplyRow] = []
    total = 0
    bar = tqdm(total=positions, desc=desc, unit="pos", disable=not progress, dynamic_ncols=True)
    while positions is None or total < positions:
        left = budget_s - (time.perf_counter() - start)
        if left <= 0:
            break
        wave = writer.wave(budget_s=WAVE_SHARE * left, token_goal=None if positions is None else positions - total,
                           size=size)
        if not wave:
            break
        for r in wave:
            prompt_len = len(writer.prompts[r.prompt])
            hidden, labels = teacher_forced(decoder.target, r.tokens)
            rows.append(reply_row(r.tokens, prompt_len, hidden, labels, r.prompt))
            total += len(r.tokens) - prompt_len
            bar.update(len(r.tokens) - prompt_len)
        if size is not None:  # one wave over the given prompts
            break
    bar.close()
    logger.info("collected %d reply positions in %d replies (%.0f s)", total, len(rows), time.perf_counter() - start)
    return rows


def medusa_decode_report(model, heads: MedusaHeads, prompts: list[list[int]], *, new_tokens: int,
                         eos: int | None) -> dict:
    """Greedy method medusa on ``prompts`` (the heads' measured tree): tokens per target forward
    and whether every output equals plain decoding's."""
    from specops.decoder import Decoder

    dec = Decoder(model, medusa=heads)
    forwards = new = exact = 0
    for ids in prompts:
        m = dec.generate(ids, method="medusa", max_new_tokens=new_tokens, eos_token_id=eos)
        a = dec.generate(ids, method="ar", max_new_tokens=new_tokens, eos_token_id=eos)
        exact += int(m.tokens == a.tokens)
        forwards += m.stats.target_forwards - (1 if len(ids) > 1 else 0)  # decode forwards (not the prompt pass)
        new += len(m.tokens)
    return {"prompts": len(prompts), "new_tokens": new, "tokens_per_target_forward": round(new / max(1, forwards), 3),
            "exact_prompts": f"{exact}/{len(prompts)}"}


HELDOUT_SHARE = 0.1  # of the collection budget, at most: the target's greedy replies to the held-out prompts


def run_chat_heads_job(job: HeadsJob, cfg: HeadsTrainConfig, data: ChatData) -> dict:
    """Chat mode: write the target's replies, train and save heads on them, report; the report as a dict.

    Within ``data.minutes``: the target writes user messages of its own (at most
    `specops.train.eagle.SELF_PROMPT_SHARE` of the collection budget), its greedy replies to the
    held-out prompts (at most `HELDOUT_SHARE`), then its replies to the training prompts (greedy,
    then sampled) until ``data.positions`` or the collection budget (``data.generate_share``);
    training takes what is left but a reserve for the held-out report (per-rank accuracy on the
    held-out replies, greedy medusa decoding of ``data.eval_prompts`` held-out prompts). With
    ``cfg.shortlist`` F the heads are trained, measured and saved ranking only the F most frequent
    tokens of the replies (decoding then reads F rows of the LM head, and so does each step).
    """
    from specops.bench.chat_suite import has_chat_template, render_messages
    from specops.decoder import Decoder
    from specops.train.checkpoint import load_causal_lm
    from specops.train.eagle import SAMPLE_TEMPERATURE, SELF_PROMPT_SHARE, plot_losses, prompt_texts
    from specops.train.self_distill import self_prompts

    cfg.validate()
    data.validate()
    start = time.perf_counter()
    budget = data.minutes * 60.0
    torch.set_num_threads(job.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = _find_tokenizer(job.model, job.tokenizer)
    if not has_chat_template(tokenizer):
        raise ValueError(f"the tokenizer of {job.model} has no chat template: chat mode trains on chat replies "
                         "(train on text with --data or --stdlib instead)")
    base = load_causal_lm(job.model)
    freeze(base)
    eos = base.config.eos_token_id if isinstance(base.config.eos_token_id, int) else tokenizer.eos_token_id
    train_text, heldout_text = prompt_texts(tokenizer, seed=cfg.seed)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    train_ids, heldout_ids = [encode(t) for t in train_text], [encode(t) for t in heldout_text]
    decoder = Decoder(base, tokenizer=tokenizer)
    collect_budget = budget * data.generate_share
    written: list[str] = []
    if data.self_prompts:
        written = self_prompts(decoder, tokenizer, data.self_prompts, seed=cfg.seed,
                               budget_s=SELF_PROMPT_SHARE * collect_budget, max_batch=data.max_batch,
                               progress=cfg.progress)
        train_ids += [encode(render_messages([("user", text)], tokenizer)) for text in written]
        random.Random(cfg.seed).shuffle(train_ids)
    held = collect_replies(decoder, heldout_ids, data, eos=eos, budget_s=HELDOUT_SHARE * collect_budget,
                           positions=None, temperature=SAMPLE_TEMPERATURE, seed=cfg.seed,
                           desc="medusa: held-out replies", size=len(heldout_ids), progress=cfg.progress)
    rows = collect_replies(decoder, train_ids, data, eos=eos,
                           budget_s=collect_budget - (time.perf_counter() - start), positions=data.positions,
                           temperature=SAMPLE_TEMPERATURE, seed=cfg.seed, desc="medusa: target replies",
                           progress=cfg.progress)
    generate_s = time.perf_counter() - start
    del decoder  # its runner's copy of the weights; the report decodes with its own
    if not rows or not held:
        raise ValueError(f"the budget allowed {len(rows)} training and {len(held)} held-out replies: "
                         "give more --minutes")
    heads = new_heads(base, cfg, job, job.model_name or str(job.model))
    answers = torch.cat([r.targets[r.targets != IGNORE] for r in rows])  # [N] the target's reply tokens
    vocab = frequency_shortlist(answers, cfg.shortlist, heads.config.vocab_size) if cfg.shortlist else None
    rng = random.Random(cfg.seed)
    eval_reserve = min(0.15 * budget, 20.0 + 0.1 * budget)
    train_budget = max(1.0, budget - (time.perf_counter() - start) - eval_reserve)
    report = HeadsReport(steps=0, wall_s=0.0)
    bf16 = inference_dtype("cpu") == torch.bfloat16  # native bf16 matmuls: the LM head pass ~1.7x as fast
    report.losses = fit_heads(heads, lambda: packed_batch(rows, cfg.batch_size, cfg.seq_len, cfg.num_heads, rng),
                              cfg, budget_s=train_budget, bf16=bf16, vocab=vocab)
    report.steps = len(report.losses)
    train_s = time.perf_counter() - start - generate_s
    finish_heads(heads, evaluate_rows(heads, held, cfg, vocab), report, answers, cfg)  # the shortlist is vocab
    held_answers = torch.cat([r.targets[r.targets != IGNORE] for r in held])  # what the shortlist should hold
    prompts = [ids[-data.max_prompt_tokens:] for ids in heldout_ids if len(ids) >= 2][: data.eval_prompts]
    heads.save_pretrained(job.out_dir)  # before the decode report: a failing report loses no training
    decode = medusa_decode_report(base, heads, prompts, new_tokens=data.eval_new_tokens, eos=eos) if prompts else {}
    report.wall_s = time.perf_counter() - start
    result = {"out": str(job.out_dir), "model": job.model_name or str(job.model), "mode": "chat",
              "heads": cfg.num_heads, "layers": cfg.num_layers, "shared_lm_head": cfg.shared_lm_head,
              "root_input": cfg.root_input, "shortlist": cfg.shortlist,
              "shortlist_coverage": None if vocab is None else round(torch.isin(held_answers, vocab).float().mean().item(), 4),
              "self_prompts": len(written), "replies": len(rows), "reply_positions": int(answers.numel()),
              "heldout_replies": len(held), "heldout_positions": sum(int((r.targets != IGNORE).sum()) for r in held),
              "generate_s": round(generate_s, 1), "train_s": round(train_s, 1), **report.to_dict(),
              "heldout_decode": decode,
              "artifact_bytes": sum((job.out_dir / name).stat().st_size for name in (CONFIG_NAME, WEIGHTS_NAME))}
    result.pop("text_top1"), result.pop("text_top5")
    (job.out_dir / "train_report.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_losses(report.losses, job.out_dir / "loss.png", title="Medusa heads training loss",
                ylabel="loss (weighted sum over heads)")
    logger.info("heads trained: %s", result)
    return result
