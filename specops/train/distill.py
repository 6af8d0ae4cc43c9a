"""Distil a small draft model from any causal-LM target (KL to the target's logits).

The draft copies the target's config with fewer layers, so it shares the vocabulary
and tokenizer by construction, and starts from the target's embeddings, first
``layers`` blocks, final norm and LM head wherever names and shapes match. Training
minimises KL(p_target || q_draft) at temperature 1 over every position: the draft
learns to predict what the target would say, which is what speculative acceptance
rewards (Leviathan et al. 2023, arXiv 2211.17192, §3).
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


def distill_draft(target, draft, windows: TokenWindows, cfg: TrainConfig) -> TrainResult:
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


def distill_from_files(job: DraftJob) -> dict:
    """Load the target and its tokenizer, distil a ``job.layers``-layer draft on
    ``job.data``, save it (fp16 safetensors + tokenizer) and report its KL and greedy
    acceptance on prompts cut from the last tenth of the token stream."""
    from transformers import AutoTokenizer

    from specops.train.checkpoint import count_parameters, load_causal_lm, save_fp16
    from specops.train.data import TokenWindows, encode_stream, read_texts
    from specops.train.evaluate import greedy_acceptance

    if not job.data:
        raise ValueError("no --data files given")
    torch.set_num_threads(job.threads)
    target = load_causal_lm(job.target)
    tokenizer = AutoTokenizer.from_pretrained(str(job.target))
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream = encode_stream(read_texts(job.data), tokenizer, eos_id=eos)   # [N]
    split = int(stream.numel() * 0.9)
    train_stream, eval_stream = stream[:split], stream[split:]
    draft = make_draft(target, job.layers, seed=job.train.seed)
    result = distill_draft(target, draft, TokenWindows(train_stream, job.train.seq_len, seed=job.train.seed), job.train)
    draft = draft.to(torch.float16).to(torch.float32).eval()
    save_fp16(draft, job.out_dir, tokenizer=tokenizer)
    prompt_len = 64
    prompts = [eval_stream[i:i + prompt_len].tolist()
               for i in range(0, max(0, eval_stream.numel() - prompt_len), prompt_len * 4)][: job.eval_prompts]
    summary = {"out": str(job.out_dir), "layers": job.layers, "parameters": count_parameters(draft),
               "steps": result.steps, "seconds": round(result.wall_s, 1),
               "final_kl": round(sum(result.losses[-10:]) / len(result.losses[-10:]), 4)}
    if prompts:
        acc = greedy_acceptance(target, draft, prompts, max_new_tokens=32, gamma=4, eos_token_id=tokenizer.eos_token_id)
        summary["greedy_acceptance"] = acc.as_dict()
    log.info("draft distilled: %s", summary)
    return summary
