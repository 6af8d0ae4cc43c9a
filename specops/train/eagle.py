"""Training an EAGLE drafter (`specops.models.eagle_model`) by self-distillation.

No dataset is downloaded: the frozen target continues prompts the project ships (the
chat-model suites' prompts of `specops.bench.chat_prompts`, rendered with the model's chat
template, for a model that has one; code prompts cut from the standard library's training
files, `specops.train.data`, otherwise) and, for a chat model, user messages it writes
itself (`specops.train.self_distill.self_prompts`). The serving engine writes the replies
in batches; one teacher-forced target forward per sequence then gives the training data: at
every position ``i`` its token ``x_i``, its last hidden state ``f_i`` (after the final
norm) and its own greedy choice ``y_i`` after ``f_i``. The first pass over the prompts
decodes greedily, later passes sample at temperature 0.8 for variety.

The drafter's entry ``i`` reads ``(x_{i+1}, f_i)`` and is trained (EAGLE's recipe) on

    smooth-L1(f̂_{i+1}, f_{i+1}) + w_cls * CE(LM head(f̂_{i+1}), y_{i+1})

with uniform noise on the input features (EAGLE's ±0.1, here relative to the features'
RMS). The cross-entropy runs over the drafter's shortlist (the most frequent target
tokens of the training data, the only tokens it drafts). The loss is also taken on
``unroll - 1`` further steps where the drafter reads its own predicted features, as it
does inside a drafted chain (`EagleDrafter.forward`).

Held-out: the bench's first prompts of each class (the first two conversations, the first
four code / QA / creative prompts; ``bench decode --suite mixed --limit 16`` and below draw
only from them) never enter training; the report measures the drafter's top-1 per chain
step on held-out sequences and greedy ``eagle`` decoding on held-out prompts.
"""

from __future__ import annotations

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

from specops.models.eagle_model import EagleDrafter

log = logging.getLogger(__name__)

HELDOUT_CONVERSATIONS, HELDOUT_PER_CLASS = 2, 4
SAMPLE_TEMPERATURE = 0.8  # passes after the first sample their continuations
SELF_PROMPT_SHARE = 0.15  # of the collection budget, at most: the target writing its own user messages
WAVE_SHARE = 0.5  # of the collection time left: one wave of replies; the teacher-forced forwards over it take the rest


@dataclass
class EagleTrainConfig:
    minutes: float = 40.0
    """Wall budget for generation, training and the held-out report together."""
    tokens: int = 400_000
    """Positions of target data to collect at most (prompt and continuation tokens)."""
    self_prompts: int = 1000
    """User messages the target writes itself (`specops.train.self_distill.self_prompts`), beside the
    shipped prompts, for a model with a chat template (0: the shipped prompts alone)."""
    max_batch: int = 64
    """Sequences the engine generates side by side while collecting (the real model on 2 cores
    writes ~330 tokens/s at 64, ~190 at 16, ~45 one at a time)."""
    steps: int | None = None
    """Stop training after this many steps (None: when the budget is spent)."""
    new_tokens: int = 160
    """Target tokens generated per prompt."""
    max_prompt_tokens: int = 384
    generate_share: float = 0.5
    """At most this share of the budget goes to generating data."""
    seq_len: int = 256
    batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int = 30
    unroll: int = 3
    """Chain steps trained: 1 = EAGLE-1 (real features only); s > 1 also feeds predicted features."""
    step_decay: float = 0.8
    cls_weight: float = 0.1
    noise: float = 0.2
    shortlist: int = 8192
    """Tokens the drafter drafts over (0: the whole vocabulary); never more than the vocabulary."""
    heldout_share: float = 0.06
    eval_prompts: int = 8
    eval_new_tokens: int = 48
    gamma: int = 4
    bf16_autocast: bool = True
    """Training forwards under bf16 autocast (fp32 weights) where the CPU has native bf16 matmuls."""
    seed: int = 0
    progress: bool = True

    def validate(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        for name in ("tokens", "new_tokens", "max_prompt_tokens", "seq_len", "batch_size", "unroll", "eval_prompts",
                     "eval_new_tokens", "gamma", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.shortlist < 0:
            raise ValueError(f"shortlist must be >= 0, got {self.shortlist}")
        if isinstance(self.self_prompts, bool) or not isinstance(self.self_prompts, int) or self.self_prompts < 0:
            raise ValueError(f"self_prompts must be an integer >= 0, got {self.self_prompts!r}")
        if not 0 < self.generate_share < 1 or not 0 < self.heldout_share < 0.5:
            raise ValueError("generate_share must be in (0, 1) and heldout_share in (0, 0.5)")


@dataclass
class TargetSequence:
    """One prompt and the target's continuation: what it computed at every position."""

    tokens: torch.Tensor  # [L] long
    features: torch.Tensor  # [L, E] bfloat16: last hidden state after the final norm
    labels: torch.Tensor  # [L] long: the target's argmax after each position
    prompt: int = 0  # which prompt it continues (a prompt's sampled repeats share it)


@dataclass
class EagleReport:
    positions: int = 0
    sequences: int = 0
    self_prompts: int = 0
    generate_s: float = 0.0
    train_s: float = 0.0
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    heldout_top1: list[float] = field(default_factory=list)
    decode: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        tail = self.losses[-20:]
        return {"positions": self.positions, "sequences": self.sequences, "self_prompts": self.self_prompts,
                "generate_s": round(self.generate_s, 1),
                "train_s": round(self.train_s, 1), "steps": self.steps,
                "final_loss": round(sum(tail) / len(tail), 4) if tail else None,
                "heldout_top1_by_step": [round(a, 4) for a in self.heldout_top1], "heldout_decode": self.decode}


# ---------------------------------------------------------------------- prompts
def prompt_texts(tokenizer, *, seed: int = 0) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts) as text (see the module docstring)."""
    from specops.bench import chat_prompts
    from specops.bench.chat_suite import has_chat_template, render_messages

    if has_chat_template(tokenizer):
        train, heldout = [], []
        for c, texts in enumerate(chat_prompts.CONVERSATIONS):
            conversation = [("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(texts)]
            for i in range(0, len(conversation), 2):
                (heldout if c < HELDOUT_CONVERSATIONS else train).append(
                    render_messages(conversation[: i + 1], tokenizer))
        for texts in (chat_prompts.CODE, chat_prompts.QA, chat_prompts.CREATIVE):
            rendered = [render_messages([("user", t)], tokenizer) for t in texts]
            heldout += rendered[:HELDOUT_PER_CLASS]
            train += rendered[HELDOUT_PER_CLASS:]
        random.Random(seed).shuffle(train)
        return train, heldout
    from specops.train.data import code_prompts, heldout_files, split_stdlib

    train = code_prompts(split_stdlib().train_files, count=200, max_chars=500, seed=seed)
    heldout = code_prompts(list(heldout_files()), count=16, max_chars=500, seed=seed)
    return train, heldout


# ---------------------------------------------------------------------- data
def collect(decoder, prompts: list[list[int]], cfg: EagleTrainConfig, *, eos: int | None, budget_s: float,
            progress: bool = True) -> list[TargetSequence]:
    """The target's continuations of ``prompts`` (token ids) and its hidden states, until
    ``cfg.tokens`` positions or ``budget_s`` seconds. Wave after wave, the serving engine
    writes the replies, ``cfg.max_batch`` at a time (`specops.train.self_distill.ReplyWriter`:
    greedy first, then the prompts repeat sampled), then one teacher-forced target forward per
    sequence gives its features and labels (`teacher_forced`). A wave's replies get at most
    `WAVE_SHARE` of the time left, so the forwards over what they wrote fit in the rest (a
    reply already written is never thrown away)."""
    from specops.train.self_distill import ReplyWriter, teacher_forced

    start = time.perf_counter()
    writer = ReplyWriter(decoder, [ids[-cfg.max_prompt_tokens:] for ids in prompts], new_tokens=cfg.new_tokens,
                         temperature=SAMPLE_TEMPERATURE, max_batch=cfg.max_batch, seed=cfg.seed, eos=eos)
    out: list[TargetSequence] = []
    total = 0
    bar = tqdm(total=cfg.tokens, desc="eagle: target data", unit="pos", disable=not progress, dynamic_ncols=True)
    while total < cfg.tokens:
        left = budget_s - (time.perf_counter() - start)
        if left <= 0:
            break
        wave = writer.wave(budget_s=WAVE_SHARE * left, token_goal=cfg.tokens - total)
        if not wave:
            break
        for r in wave:
            features, labels = teacher_forced(decoder.target, r.tokens)
            out.append(TargetSequence(tokens=torch.tensor(r.tokens, dtype=torch.long), features=features,
                                      labels=labels, prompt=r.prompt))
            total += len(r.tokens)
            bar.update(len(r.tokens))
    bar.close()
    log.info("collected %d positions in %d sequences (%.0f s)", total, len(out), time.perf_counter() - start)
    return out


def split_by_prompt(seqs: list[TargetSequence], share: float) -> tuple[list[TargetSequence], list[TargetSequence]]:
    """(held out, training): the prompts of the first ``share`` of ``seqs`` and every sequence that
    continues one of them are held out, so the held-out top-1 reads prompts the drafter never
    trained on (a prompt's sampled repeats would otherwise train on the held-out prompt's text)."""
    cut = max(1, round(len(seqs) * share))
    prompts = {s.prompt for s in seqs[:cut]}
    held = [s for s in seqs if s.prompt in prompts]
    train = [s for s in seqs if s.prompt not in prompts]
    if not train:
        raise ValueError("every target sequence continues a held-out prompt: give more --minutes or --tokens")
    return held, train


def frequent_tokens(seqs: list[TargetSequence], size: int, vocab: int) -> torch.Tensor | None:
    """The ``size`` most frequent target choices in ``seqs`` (None: ``size`` 0 or >= the vocabulary).
    Tokens that never occur fill the rest in id order."""
    if size == 0 or size >= vocab:
        return None
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.labels, minlength=vocab)
        counts += torch.bincount(s.tokens, minlength=vocab)
    return torch.sort(torch.topk(counts, size).indices).values


class Windows:
    """Random training windows over sequences (padded; ``valid`` marks real entries)."""

    def __init__(self, seqs: list[TargetSequence], seq_len: int, seed: int) -> None:
        self.seqs = [s for s in seqs if s.tokens.numel() >= 3]
        if not self.seqs:
            raise ValueError("no target sequence of 3 positions or more to train on")
        self.seq_len = seq_len
        self.rng = random.Random(seed)

    def batch(self, size: int) -> dict[str, torch.Tensor]:
        picks = [self.rng.choice(self.seqs) for _ in range(size)]
        return window_batch(picks, self.seq_len, self.rng)


def window_batch(picks: list[TargetSequence], seq_len: int, rng: random.Random | None = None) -> dict[str, torch.Tensor]:
    """Entries for the drafter: token x_{i+1}, feature f_i, target f_{i+1}, label y_{i+1}; [B, T] / [B, T, E]."""
    rows = []
    for s in picks:
        n = s.tokens.numel()
        width = min(seq_len + 1, n)
        start = rng.randrange(0, n - width + 1) if rng is not None else 0
        rows.append((s, start, width))
    t = max(w for _, _, w in rows) - 1
    e = picks[0].features.shape[1]
    b = len(picks)
    tokens = torch.zeros(b, t, dtype=torch.long)
    labels = torch.zeros(b, t, dtype=torch.long)
    feats = torch.zeros(b, t, e)
    target = torch.zeros(b, t, e)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for r, (s, start, width) in enumerate(rows):
        w = width - 1
        tokens[r, :w] = s.tokens[start + 1 : start + width]
        labels[r, :w] = s.labels[start + 1 : start + width]
        feats[r, :w] = s.features[start : start + w].float()
        target[r, :w] = s.features[start + 1 : start + width].float()
        valid[r, :w] = True
    return {"tokens": tokens, "features": feats, "target": target, "labels": labels, "valid": valid}


# ---------------------------------------------------------------------- training
def losses(drafter: EagleDrafter, batch: dict[str, torch.Tensor], cfg: EagleTrainConfig,
           gen: torch.Generator | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """EAGLE's loss over ``cfg.unroll`` chain steps; also each step's top-1 agreement [on valid rows]."""
    feats = batch["features"]
    if gen is not None and cfg.noise > 0:
        rms = feats.pow(2).mean().sqrt()
        feats = feats + (torch.rand(feats.shape, generator=gen) - 0.5) * cfg.noise * rms
    outs = drafter(batch["tokens"], feats, steps=cfg.unroll)
    shortlist = drafter.shortlist
    labels = batch["labels"]
    if shortlist is not None:  # label -> its shortlist index (-100 when not listed)
        lookup = torch.full((drafter.config.vocab_size,), -100, dtype=torch.long)
        lookup[shortlist] = torch.arange(shortlist.numel())
        labels = lookup[labels]
    total = torch.zeros(())
    top1 = []
    for s, pred in enumerate(outs):
        valid = batch["valid"].clone()
        valid[:, :s] = False
        if not bool(valid.any()):
            top1.append(torch.tensor(float("nan")))
            continue
        p, tgt = pred[valid], batch["target"][valid]
        reg = F.smooth_l1_loss(p, tgt, reduction="none").mean(-1)
        logits = drafter.logits(p)
        lab = labels[valid]
        cls = F.cross_entropy(logits, lab, ignore_index=-100, reduction="none")
        weight = cfg.step_decay ** s
        total = total + weight * (reg.mean() + cfg.cls_weight * cls.sum() / max(1, int((lab >= 0).sum())))
        top1.append((logits.argmax(-1) == lab).float().mean().detach())
    return total, top1


def _cpu_bf16() -> bool:
    from specops.models.medusa_heads import inference_dtype

    return inference_dtype("cpu") == torch.bfloat16


def train_drafter(drafter: EagleDrafter, train: list[TargetSequence], cfg: EagleTrainConfig, *, budget_s: float,
                  report: EagleReport) -> None:
    """Train ``drafter`` in place for ``cfg.steps`` steps or ``budget_s`` seconds."""
    windows = Windows(train, cfg.seq_len, cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    drafter.train()
    bf16 = cfg.bf16_autocast and _cpu_bf16()
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc="eagle: training", disable=not cfg.progress, dynamic_ncols=True)
    step = 0
    while True:
        elapsed = time.perf_counter() - start
        if (cfg.steps is not None and step >= cfg.steps) or (step > 0 and elapsed >= budget_s):
            break
        done = step / cfg.steps if cfg.steps is not None else elapsed / budget_s
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, top1 = losses(drafter, windows.batch(cfg.batch_size), cfg, gen)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        report.losses.append(float(loss.detach()))
        step += 1
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{float(top1[0]):.2f}")
    bar.close()
    drafter.eval()
    report.steps = step
    report.train_s = time.perf_counter() - start


def heldout_top1(drafter: EagleDrafter, seqs: list[TargetSequence], cfg: EagleTrainConfig) -> list[float]:
    """Top-1 agreement of each chain step with the target's choice over held-out sequences."""
    hits = [0.0] * cfg.unroll
    rows = [0] * cfg.unroll
    with torch.no_grad():
        for s in seqs:
            if s.tokens.numel() < 3:
                continue
            batch = window_batch([s], cfg.max_prompt_tokens + cfg.new_tokens)
            _, top1 = losses(drafter, batch, cfg)
            n = int(batch["valid"].sum())
            for k, a in enumerate(top1):
                if not math.isnan(float(a)):
                    hits[k] += float(a) * (n - k)
                    rows[k] += n - k
    return [h / r if r else 0.0 for h, r in zip(hits, rows)]


def decode_report(model, drafter: EagleDrafter, prompts: list[list[int]], cfg: EagleTrainConfig,
                  eos: int | None) -> dict:
    """Greedy ``eagle`` decoding of held-out prompts: tokens per target forward, acceptance, exactness."""
    from specops.decoder import Decoder

    dec = Decoder(model, eagle=drafter)
    forwards = new = drafted = accepted = 0
    exact = 0
    for ids in prompts:
        e = dec.generate(ids, method="eagle", gamma=cfg.gamma, max_new_tokens=cfg.eval_new_tokens, eos_token_id=eos)
        a = dec.generate(ids, method="ar", max_new_tokens=cfg.eval_new_tokens, eos_token_id=eos)
        exact += int(a.tokens == e.tokens)
        s = e.stats
        forwards += s.target_forwards - (1 if len(ids) > 1 else 0)  # decode forwards (not the prompt pass)
        new += len(e.tokens)
        drafted += s.drafted
        accepted += s.accepted
    return {"prompts": len(prompts), "gamma": cfg.gamma, "new_tokens": new,
            "tokens_per_target_forward": round(new / max(1, forwards), 3),
            "acceptance_rate": round(accepted / max(1, drafted), 4), "exact_prompts": f"{exact}/{len(prompts)}"}


def plot_losses(losses: list[float], path: Path, *, title: str = "EAGLE drafter training loss",
                ylabel: str = "loss") -> Path:
    """The training loss by step (and its running mean) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="step")
    if len(losses) >= 20:
        k = max(5, len(losses) // 50)
        ax.plot(steps, [sum(losses[max(0, i - k + 1) : i + 1]) / min(k, i + 1) for i in range(len(losses))],
                lw=1.5, label=f"mean of {k}")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@dataclass
class EagleJob:
    model: Path
    out_dir: Path
    model_name: str = ""
    threads: int = 2


def run_eagle_job(job: EagleJob, cfg: EagleTrainConfig) -> dict:
    """Load the target, collect its data, train, report and save the drafter; the report as a dict."""
    from specops.bench.chat_suite import render_messages
    from specops.decoder import Decoder
    from specops.models.eagle_io import REPORT_NAME, save_drafter
    from specops.train.checkpoint import load_causal_lm
    from specops.train.self_distill import self_prompts
    from specops.train.tokenizer import load_tokenizer

    cfg.validate()
    torch.set_num_threads(job.threads)
    start = time.perf_counter()
    budget = cfg.minutes * 60.0
    model = load_causal_lm(job.model).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tokenizer = load_tokenizer(job.model)
    eos = tokenizer.eos_token_id
    train_text, heldout_text = prompt_texts(tokenizer, seed=cfg.seed)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    train_ids = [encode(t) for t in train_text]
    heldout_ids = [encode(t)[-cfg.max_prompt_tokens:] for t in heldout_text]
    decoder = Decoder(model, tokenizer=tokenizer)
    report = EagleReport()
    collect_budget = budget * cfg.generate_share
    if cfg.self_prompts:
        written = self_prompts(decoder, tokenizer, cfg.self_prompts, seed=cfg.seed,
                               budget_s=SELF_PROMPT_SHARE * collect_budget, max_batch=cfg.max_batch,
                               progress=cfg.progress)
        report.self_prompts = len(written)
        train_ids += [encode(render_messages([("user", text)], tokenizer)) for text in written]
        random.Random(cfg.seed).shuffle(train_ids)
    seqs = collect(decoder, train_ids, cfg, eos=eos, budget_s=collect_budget - (time.perf_counter() - start),
                   progress=cfg.progress)
    report.generate_s = time.perf_counter() - start
    if len(seqs) < 2:
        raise ValueError("the budget allowed fewer than 2 target sequences: give more --minutes")
    held, train = split_by_prompt(seqs, cfg.heldout_share)
    report.sequences, report.positions = len(seqs), sum(s.tokens.numel() for s in seqs)
    vocab = model.config.vocab_size
    drafter = EagleDrafter.for_target(model, shortlist=frequent_tokens(train, cfg.shortlist, vocab), seed=cfg.seed)
    with torch.no_grad():  # fc starts by passing the feature through: the layer learns the change
        e = drafter.config.hidden_size
        drafter.fc.weight[:, e:] += torch.eye(e)
    eval_reserve = min(0.15 * budget, 20.0 + 0.1 * budget)
    train_budget = max(1.0, budget - (time.perf_counter() - start) - eval_reserve)
    train_drafter(drafter, train, cfg, budget_s=train_budget, report=report)
    report.heldout_top1 = heldout_top1(drafter, held, cfg)

    def summary() -> dict:
        return {"model": job.model_name or str(job.model), **report.to_dict(),
                "shortlist": drafter.config.shortlist_size, "unroll": cfg.unroll,
                "wall_s": round(time.perf_counter() - start, 1)}

    # the trained drafter is written before the decode report, so a failing report loses no training
    out = save_drafter(drafter, job.out_dir, report=summary())
    plot_losses(report.losses, out / "loss.png")
    prompts = [p for p in heldout_ids if len(p) >= 2][: cfg.eval_prompts]
    report.decode = decode_report(model, drafter, prompts, cfg, eos) if prompts else {}
    result = summary()
    (out / REPORT_NAME).write_text(json.dumps(result, indent=2) + "\n")
    result["out_dir"] = str(out)
    result["checkpoint_bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.name == "model.safetensors")
    return result
