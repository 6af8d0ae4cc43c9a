"""Distil a small draft model from any causal-LM target (KL to the target's logits).

The draft copies the target's config with fewer layers, so it shares the vocabulary
and tokenizer by construction, and starts from the target's embeddings, first
``layers`` blocks, final norm and LM head wherever names and shapes match. Training
minimises KL(p_target || q_draft) at temperature 1 over every position: the draft
learns to predict what the target would say, which is what speculative acceptance
rewards (Leviathan et al. 2023, arXiv 2211.17192, §3).

Self-distillation (``SelfDistill.sequences > 0``): most rows of every batch are the
target's own greedy continuations of prompts cut from the data, the rest real text.
At decoding time the draft always continues the target's output, not human text, so
training on that output is what raises acceptance; the KL still covers every
position, so the draft keeps matching the full distribution (sampled requests).
Starting from an existing draft (``init_draft``) continues its training.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specops.train.data import TokenWindows
from specops.train.target import TrainConfig, TrainResult, make_optimizer, run_loop

log = logging.getLogger(__name__)

# Config attribute that holds the layer count, across transformers architectures.
_LAYER_ATTRS = ("num_hidden_layers", "n_layer", "num_layers")


def _layer_attr(config) -> str:
    for name in _LAYER_ATTRS:
        if isinstance(getattr(config, name, None), int):
            return name
    raise ValueError(f"cannot find the layer count in {type(config).__name__} (tried {', '.join(_LAYER_ATTRS)})")


def make_draft(target, layers: int, *, init_from_target: bool = True, seed: int = 0):
    """A ``layers``-layer copy of the target's architecture (same vocab), initialised
    from the target's weights where parameter names and shapes match."""
    from transformers import AutoModelForCausalLM

    attr = _layer_attr(target.config)
    target_layers = getattr(target.config, attr)
    if not 1 <= layers:
        raise ValueError(f"draft layers must be >= 1, got {layers}")
    if layers >= target_layers:
        raise ValueError(f"draft layers ({layers}) must be fewer than the target's ({target_layers})")
    config = copy.deepcopy(target.config)
    setattr(config, attr, layers)
    if hasattr(config, "layer_types") and isinstance(config.layer_types, list):
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(seed)
    draft = AutoModelForCausalLM.from_config(config)
    draft.to(torch.float32)
    if init_from_target:
        own = draft.state_dict()
        src = target.state_dict()
        shared = {k: v.detach().to(torch.float32) for k, v in src.items() if k in own and own[k].shape == v.shape}
        draft.load_state_dict(shared, strict=False)
        log.info("draft: %d/%d tensors initialised from the target", len(shared), len(own))
    return draft


def kl_loss(target, draft, batch: torch.Tensor) -> torch.Tensor:
    """Mean KL(p_target || q_draft) per token (nats). batch: [B, T+1] long."""
    inputs = batch[:, :-1]                                                   # [B, T]
    with torch.no_grad():
        p_logits = target(input_ids=inputs, use_cache=False).logits.float()  # [B, T, V]
    q_logits = draft(input_ids=inputs, use_cache=False).logits.float()      # [B, T, V]
    vocab = q_logits.shape[-1]
    log_q = F.log_softmax(q_logits.reshape(-1, vocab), dim=-1)               # [B*T, V]
    log_p = F.log_softmax(p_logits.reshape(-1, vocab), dim=-1)               # [B*T, V]
    return F.kl_div(log_q, log_p, reduction="batchmean", log_target=True)


@dataclass(frozen=True)
class SelfDistill:
    """How much of the draft's training data is the target's own greedy output."""

    sequences: int = 0          # greedy continuations generated once before training (0: off)
    share: float = 0.75         # fraction of every batch's rows drawn from them
    prompt_len: int = 32        # data tokens each continuation starts from
    batch_size: int = 32        # continuations generated per batch

    def validate(self, seq_len: int) -> None:
        if self.sequences < 0:
            raise ValueError(f"self-distill sequences must be >= 0, got {self.sequences}")
        if not 0 < self.share <= 1:
            raise ValueError(f"self-distill share must be in (0, 1], got {self.share}")
        if self.batch_size < 1:
            raise ValueError(f"self-distill batch size must be >= 1, got {self.batch_size}")
        if not 1 <= self.prompt_len < seq_len:
            raise ValueError(f"self-distill prompt length must be in [1, seq_len={seq_len}), got {self.prompt_len}")


@torch.no_grad()
def greedy_pool(target, stream: torch.Tensor, length: int, sd: SelfDistill, *, seed: int = 0,
                progress: bool = True) -> torch.Tensor:
    """``sd.sequences`` rows of ``length`` tokens: a random ``sd.prompt_len``-token
    prompt cut from ``stream`` [N], then the target's greedy continuation. -> [S, length]"""
    from specops.train.heads import greedy_rows

    return greedy_rows(target, stream, sequences=sd.sequences, prompt_len=sd.prompt_len, length=length,
                       batch_size=sd.batch_size, gen=torch.Generator().manual_seed(seed), progress=progress)


class MixedBatches:
    """Training batches whose rows are ``share`` target continuations (``pool``) and
    the rest random text windows, in that order; seeded."""

    def __init__(self, pool: torch.Tensor, windows: TokenWindows, share: float, *, seed: int = 0):  # pool: [S, T+1]
        if pool.dim() != 2 or pool.shape[0] < 1:
            raise ValueError(f"pool must be [S >= 1, T+1], got {tuple(pool.shape)}")
        if pool.shape[1] != windows.seq_len + 1:
            raise ValueError(f"pool rows have {pool.shape[1]} tokens, windows {windows.seq_len + 1}")
        self.pool, self.windows, self.share = pool, windows, share
        self.seq_len = windows.seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int) -> torch.Tensor:
        """Returns: [B, seq_len + 1] long."""
        n_pool = min(batch_size, max(1, round(batch_size * self.share)))
        rows = torch.randint(0, self.pool.shape[0], (n_pool,), generator=self.generator)
        parts = [self.pool[rows]]
        if batch_size > n_pool:
            parts.append(self.windows.batch(batch_size - n_pool))
        return torch.cat(parts)


def distill_draft(target, draft, windows: TokenWindows | MixedBatches, cfg: TrainConfig) -> TrainResult:
    """Train ``draft`` to match ``target``'s next-token distribution on ``windows``."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"vocabularies differ: target {target.config.vocab_size}, draft {draft.config.vocab_size}")
    torch.manual_seed(cfg.seed)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    draft.train()
    optimizer = make_optimizer(draft, cfg)
    result = run_loop(lambda b: kl_loss(target, draft, b), optimizer, windows, cfg, desc="draft")
    draft.eval()
    return result


@dataclass
class DraftJob:
    """``specops train draft``: distil a draft for a target from text files."""

    target: Path
    layers: int
    data: list[Path]
    out_dir: Path
    train: TrainConfig
    threads: int = 2
    eval_prompts: int = 8
    eval_new_tokens: int = 32
    init_draft: Path | None = None          # continue this draft instead of starting from the target's layers
    self_distill: SelfDistill = SelfDistill()
    stdlib: bool = False                    # data: the stdlib's training split; eval: held-out code prompts
    command: str | None = None              # recorded in the report


def distill_from_files(job: DraftJob) -> dict:
    """Load the target and its tokenizer, distil a ``job.layers``-layer draft (or
    continue ``job.init_draft``) on ``job.data``, save it (fp16 safetensors, tokenizer,
    ``train_report.json``) and report its KL and greedy acceptance, before and after
    when continuing. Eval prompts: with ``job.stdlib`` the held-out stdlib code prompts
    (``specops bench decode --suite code``'s), else prompts cut from the last tenth of
    the token stream (which is then not trained on)."""
    import json
    import time

    from transformers import AutoTokenizer

    from specops.train.checkpoint import count_parameters, load_causal_lm, save_fp16
    from specops.train.data import TokenWindows, code_prompts, encode_stream, read_texts, split_stdlib
    from specops.train.evaluate import greedy_acceptance

    started = time.perf_counter()
    job.self_distill.validate(job.train.seq_len + 1)
    if job.stdlib:
        split = split_stdlib()
        files = list(split.train_files)
    else:
        files = list(job.data)
    if not files:
        raise ValueError("no --data files given")
    torch.set_num_threads(job.threads)
    target = load_causal_lm(job.target)
    tokenizer = AutoTokenizer.from_pretrained(str(job.target))
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream = encode_stream(read_texts(files), tokenizer, eos_id=eos)   # [N]
    if job.stdlib:
        train_stream = stream
        texts = code_prompts(split.heldout_files, count=job.eval_prompts, seed=0)
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:
        cut = int(stream.numel() * 0.9)
        train_stream, eval_stream = stream[:cut], stream[cut:]
        prompt_len = 64
        prompts = [eval_stream[i:i + prompt_len].tolist()
                   for i in range(0, max(0, eval_stream.numel() - prompt_len), prompt_len * 4)][: job.eval_prompts]

    def acceptance(model) -> dict | None:
        if not prompts:
            return None
        return greedy_acceptance(target, model, prompts, max_new_tokens=job.eval_new_tokens, gamma=4,
                                 eos_token_id=tokenizer.eos_token_id).as_dict()

    summary: dict = {"out": str(job.out_dir), "layers": job.layers}
    if job.init_draft is not None:
        draft = load_causal_lm(job.init_draft)
        layers = getattr(draft.config, _layer_attr(draft.config))
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"--init-draft vocabulary {draft.config.vocab_size} != the target's {target.config.vocab_size}")
        summary.update(layers=layers, init_draft=str(job.init_draft), greedy_acceptance_before=acceptance(draft))
    else:
        draft = make_draft(target, job.layers, seed=job.train.seed)
    windows = TokenWindows(train_stream, job.train.seq_len, seed=job.train.seed)
    sd = job.self_distill
    if sd.sequences:
        t0 = time.perf_counter()
        pool = greedy_pool(target, train_stream, job.train.seq_len + 1, sd, seed=job.train.seed + 1,
                           progress=job.train.progress)
        summary["self_distill"] = {"sequences": sd.sequences, "share": sd.share, "prompt_len": sd.prompt_len,
                                   "generate_s": round(time.perf_counter() - t0, 1)}
        batches: TokenWindows | MixedBatches = MixedBatches(pool, windows, sd.share, seed=job.train.seed + 2)
    else:
        batches = windows
    result = distill_draft(target, draft, batches, job.train)
    draft = draft.to(torch.float16).to(torch.float32).eval()
    save_fp16(draft, job.out_dir, tokenizer=tokenizer)
    summary.update({"parameters": count_parameters(draft), "steps": result.steps, "seconds": round(result.wall_s, 1),
                    "final_kl": round(sum(result.losses[-10:]) / len(result.losses[-10:]), 4)})
    after = acceptance(draft)
    if after is not None:
        summary["greedy_acceptance"] = after
        summary["eval"] = {"prompts": len(prompts), "new_tokens": job.eval_new_tokens,
                           "source": "held-out stdlib code prompts" if job.stdlib else "last tenth of the data"}
    summary["train"] = {"batch_size": job.train.batch_size, "seq_len": job.train.seq_len, "lr": job.train.lr,
                        "minutes": job.train.minutes, "bf16_autocast": job.train.bf16_autocast,
                        "train_tokens": int(train_stream.numel()), "threads": job.threads}
    if job.command:
        summary["command"] = job.command
    summary["wall_s_total"] = round(time.perf_counter() - started, 1)
    (job.out_dir / "train_report.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("draft distilled: %s", summary)
    return summary
