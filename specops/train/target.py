"""The bundled target: a small Llama trained from scratch on stdlib source.

Also holds the shared pieces of both training loops (``TrainConfig``, the cosine
learning-rate schedule, held-out loss), which ``distill.py`` reuses.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specops.train.data import TokenWindows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetShape:
    """Architecture of the bundled target (a LlamaConfig subset)."""

    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 1024


@dataclass
class TrainConfig:
    """One training run: optimiser, batch geometry and budget."""

    steps: int = 300                    # optimiser steps (after the budget estimate, if any)
    batch_size: int = 8                 # sequences per step
    seq_len: int = 512                  # tokens per sequence (covers prompt + generation positions)
    lr: float = 3e-3                    # peak learning rate
    min_lr_ratio: float = 0.1           # final lr = lr * min_lr_ratio (cosine)
    warmup_fraction: float = 0.05       # share of training spent warming up the lr
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    minutes: float | None = None        # wall-clock budget instead of `steps` (schedule follows time)
    bf16_autocast: bool = False         # CPU bf16 autocast for the forward (weights/optimiser stay fp32)
    progress: bool = True
    log_every: int = 10

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 < self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in (0, 1), got {self.warmup_fraction}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")


@dataclass
class TrainResult:
    """What a training run did (losses are nats/token)."""

    steps: int
    wall_s: float
    losses: list[float] = field(default_factory=list)   # one per step
    tokens_per_s: float = 0.0


def cosine_lr(progress: float, cfg: TrainConfig) -> float:
    """Linear warm-up over the first ``warmup_fraction`` of training, then cosine decay
    from ``lr`` to ``lr * min_lr_ratio``. ``progress`` is in [0, 1]: steps done / steps
    planned, or elapsed / budget for a wall-clock budget."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < cfg.warmup_fraction:
        return cfg.lr * max(progress / cfg.warmup_fraction, 0.02)
    frac = (progress - cfg.warmup_fraction) / max(1e-9, 1 - cfg.warmup_fraction)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def build_target_config(vocab_size: int, *, shape: TargetShape = TargetShape(), bos_id: int = 0,
                        eos_id: int = 1, pad_id: int = 2):
    """A LlamaConfig for the bundled target (tied embeddings to save space)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms / biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )


def run_loop(step_fn: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer,
             windows: TokenWindows, cfg: TrainConfig, *, desc: str) -> TrainResult:
    """The optimisation loop shared by target training and distillation.

    ``step_fn(batch)`` takes [B, T+1] tokens and returns the scalar loss to minimise.
    Without ``cfg.minutes`` it runs exactly ``cfg.steps`` steps (bit-reproducible for a
    seed). With ``cfg.minutes`` the schedule follows wall-clock progress and training
    stops when the budget is spent — robust on a shared, contended CPU; the step count
    reached is logged and returned so a run can be repeated exactly with fixed steps.
    """
    cfg.validate()
    budget_s = cfg.minutes * 60 if cfg.minutes is not None else None
    result = TrainResult(steps=0, wall_s=0.0)
    start = time.perf_counter()
    bar = tqdm(total=None if budget_s else cfg.steps, desc=desc, disable=not cfg.progress, dynamic_ncols=True)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    step = 0
    while True:
        elapsed = time.perf_counter() - start
        progress = elapsed / budget_s if budget_s else step / cfg.steps
        if progress >= 1.0:
            break
        lr = cosine_lr(progress, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = windows.batch(cfg.batch_size)  # [B, T+1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            loss = step_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"{desc}: loss became {value} at step {step}")
        result.losses.append(value)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{value:.3f}", lr=f"{lr:.2e}", min=f"{elapsed / 60:.1f}")
        if cfg.log_every and step % cfg.log_every == 0:
            log.info("%s step %d loss %.4f lr %.2e elapsed %.0f s", desc, step, value, lr, elapsed)
    bar.close()
    result.steps = step
    result.wall_s = time.perf_counter() - start
    result.tokens_per_s = step * cfg.batch_size * cfg.seq_len / max(result.wall_s, 1e-9)
    log.info("%s: %d steps in %.0f s (%.0f tokens/s)", desc, step, result.wall_s, result.tokens_per_s)
    return result


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (nats/token). batch: [B, T+1] long."""
    inputs, targets = batch[:, :-1], batch[:, 1:]                 # [B, T], [B, T]
    logits = model(input_ids=inputs, use_cache=False).logits      # [B, T, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def train_target(model, windows: TokenWindows, cfg: TrainConfig) -> TrainResult:
    """Train ``model`` (any HF causal LM) on random windows with next-token loss."""
    torch.manual_seed(cfg.seed)
    model.train()
    optimizer = make_optimizer(model, cfg)
    result = run_loop(lambda b: lm_loss(model, b), optimizer, windows, cfg, desc="target")
    model.eval()
    return result


@torch.no_grad()
def heldout_loss(model, windows: TokenWindows, *, batch_size: int = 8, max_batches: int = 16) -> float:
    """Mean next-token loss (nats/token) over the first non-overlapping held-out windows."""
    model.eval()
    total, count = 0.0, 0
    for batch in windows.sequential(batch_size, max_batches):  # [b, T+1]
        n = batch[:, 1:].numel()
        total += float(lm_loss(model, batch)) * n
        count += n
    if count == 0:
        raise ValueError("held-out stream too short for one window")
    return total / count
