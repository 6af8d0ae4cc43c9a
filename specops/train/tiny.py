"""``specops train tiny``: reproduce the bundled tokenizer, target and draft.

Steps (all seeded): list the stdlib (tests held out) -> train the byte-level BPE ->
encode -> train the Llama target -> distil the draft -> measure held-out loss and
the draft's greedy acceptance -> save fp16 safetensors + ``train_report.json``.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specops.train.checkpoint import count_parameters, load_causal_lm, save_fp16
from specops.train.data import TokenWindows, code_prompts, encode_stream, read_texts, split_stdlib
from specops.train.distill import distill_draft, make_draft
from specops.train.evaluate import greedy_acceptance
from specops.train.target import TargetShape, TrainConfig, build_target_config, heldout_loss, train_target
from specops.train.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

log = logging.getLogger(__name__)


@dataclass
class TinyConfig:
    """Everything that determines the bundled models."""

    out_dir: Path
    minutes: float | None = 26.0         # wall budget for both training phases together
    target_share: float = 0.75           # fraction of `minutes` spent on the target
    target_steps: int = 300              # used when minutes is None
    draft_steps: int = 100               # used when minutes is None
    seed: int = 0
    vocab_size: int = 4096
    shape: TargetShape = field(default_factory=TargetShape)
    draft_layers: int = 1
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 2e-3
    draft_lr: float = 1e-3
    threads: int = 2
    bf16_autocast: bool = True           # bf16 autocast forward on CPU (~2x faster here); fp32 master weights
    eval_prompts: int = 20
    eval_new_tokens: int = 64
    progress: bool = True
    stdlib: Path | None = None           # default: this interpreter's stdlib
    max_files: int | None = None         # limit training files (tests / smoke runs)
    init_target: Path | None = None      # continue training this target (and keep its tokenizer)

    def validate(self) -> None:
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if not 0 < self.target_share < 1:
            raise ValueError(f"target_share must be in (0, 1), got {self.target_share}")
        if self.draft_layers < 1 or self.draft_layers >= self.shape.num_layers:
            raise ValueError(f"draft_layers must be in [1, {self.shape.num_layers - 1}], got {self.draft_layers}")


def train_tiny(cfg: TinyConfig) -> dict:
    """Train and save the bundled models into ``cfg.out_dir``; returns the report."""
    from transformers import AutoModelForCausalLM

    cfg.validate()
    started = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out_dir)
    split = split_stdlib(cfg.stdlib)
    train_files = split.train_files[: cfg.max_files] if cfg.max_files else split.train_files
    train_texts = read_texts(train_files)
    heldout_texts = read_texts(split.heldout_files[::7][:40])

    t0 = time.perf_counter()
    if cfg.init_target is not None:
        tokenizer = load_tokenizer(cfg.init_target)
    else:
        tokenizer = train_tokenizer(train_texts, vocab_size=cfg.vocab_size)
    save_tokenizer(tokenizer, out)
    tokenizer_s = time.perf_counter() - t0
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    train_stream = encode_stream(train_texts, tokenizer, eos_id=eos)      # [N]
    heldout_stream = encode_stream(heldout_texts, tokenizer, eos_id=eos)  # [M]
    log.info("tokens: train %d, held-out %d", train_stream.numel(), heldout_stream.numel())

    torch.manual_seed(cfg.seed)
    if cfg.init_target is not None:
        target = load_causal_lm(cfg.init_target)
        if target.config.vocab_size != len(tokenizer):
            raise ValueError(f"{cfg.init_target}: model vocab {target.config.vocab_size} != tokenizer {len(tokenizer)}")
    else:
        config = build_target_config(len(tokenizer), shape=cfg.shape, bos_id=bos, eos_id=eos, pad_id=pad)
        target = AutoModelForCausalLM.from_config(config).to(torch.float32)
    target_cfg = TrainConfig(
        steps=cfg.target_steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, lr=cfg.lr, seed=cfg.seed,
        bf16_autocast=cfg.bf16_autocast, warmup_fraction=0.1,
        minutes=cfg.minutes * cfg.target_share if cfg.minutes else None, progress=cfg.progress,
    )
    target_result = train_target(target, TokenWindows(train_stream, cfg.seq_len, seed=cfg.seed), target_cfg)
    # Round-trip through fp16 now so training of the draft and every figure below use the shipped weights.
    target = target.to(torch.float16).to(torch.float32).eval()
    save_fp16(target, out / "target", tokenizer=tokenizer)

    draft = make_draft(target, cfg.draft_layers, seed=cfg.seed)
    draft_cfg = TrainConfig(
        steps=cfg.draft_steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, lr=cfg.draft_lr,
        seed=cfg.seed + 1, warmup_fraction=0.02, bf16_autocast=cfg.bf16_autocast,
        minutes=cfg.minutes * (1 - cfg.target_share) if cfg.minutes else None, progress=cfg.progress,
    )
    draft_result = distill_draft(target, draft, TokenWindows(train_stream, cfg.seq_len, seed=cfg.seed + 1), draft_cfg)
    draft = draft.to(torch.float16).to(torch.float32).eval()
    save_fp16(draft, out / "draft", tokenizer=tokenizer)
    train_s = time.perf_counter() - started

    heldout = TokenWindows(heldout_stream, cfg.seq_len, seed=cfg.seed)
    prompts = code_prompts(split.heldout_files, count=cfg.eval_prompts, seed=cfg.seed)
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    acceptance = greedy_acceptance(target, draft, prompt_ids, max_new_tokens=cfg.eval_new_tokens, gamma=4,
                                   eos_token_id=eos)
    report = {
        "command": "specops train tiny",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": cfg.threads, "processor": platform.processor() or platform.machine()},
        "data": {"train_files": len(train_files), "train_tokens": int(train_stream.numel()),
                 "heldout_files": len(heldout_texts), "heldout_tokens": int(heldout_stream.numel())},
        "tokenizer": {"vocab_size": len(tokenizer), "seconds": round(tokenizer_s, 1)},
        "target": {"parameters": count_parameters(target), "steps": target_result.steps,
                   "seconds": round(target_result.wall_s, 1), "final_train_loss": _tail_mean(target_result.losses),
                   "heldout_loss_nats": round(heldout_loss(target, heldout), 4),
                   "train_tokens_per_s": round(target_result.tokens_per_s, 1)},
        "draft": {"layers": cfg.draft_layers, "parameters": count_parameters(draft), "steps": draft_result.steps,
                  "seconds": round(draft_result.wall_s, 1), "final_kl": _tail_mean(draft_result.losses),
                  "heldout_loss_nats": round(heldout_loss(draft, heldout), 4),
                  "greedy_acceptance": acceptance.as_dict()},
        "wall_s_training": round(train_s, 1),
        "wall_s_total": round(time.perf_counter() - started, 1),
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log.info("train tiny done in %.0f s: target held-out loss %.3f, draft acceptance %.3f",
             report["wall_s_total"], report["target"]["heldout_loss_nats"], acceptance.acceptance_rate)
    return report


def _tail_mean(values: list[float], n: int = 20) -> float:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 4) if tail else float("nan")
