"""Click command ``specops train heads`` (thin: validate options, call `specops.train.heads.run_heads_job`
or, with ``--chat``, `specops.train.heads.run_chat_heads_job`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click
from click.core import ParameterSource

from specops.models.cli import MODEL_FOLDER
from specops.train.cli_options import reply_data_options

TEXT_ONLY = ("heldout_files", "self_distill", "distill_sequences")
CHAT_ONLY = ("minutes", "tokens", "self_prompts", "max_batch")
CHAT_MINUTES = 20.0
CHAT_SHORTLIST = 8192
TEXT_STEPS = 300


def _flag(name: str) -> str:
    return {"heldout_files": "--heldout", "max_batch": "--batch"}.get(name, "--" + name.replace("_", "-"))


@click.command("heads")
@click.option("--model", "model_ref", required=True,
              help="Base model folder (any transformers causal LM) or a registered model's name "
                   "(`specops models list`); it stays frozen.")
@click.option("--chat", is_flag=True,
              help="Train on the model's own chat replies (it needs a chat template): its greedy, then sampled, "
                   "replies to the chat-model suites' prompts and to user messages it writes itself, written by "
                   "the serving engine; the heads learn its greedy tokens at reply positions. The benchmark's first "
                   "prompts are held out. Budget: --minutes.")
@click.option("--data", "data_files", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text files to train on (repeat the option, or pass a shell glob).")
@click.option("--stdlib", is_flag=True,
              help="Train on this interpreter's stdlib and measure on its held-out files (as `train tiny` "
                   "splits it) instead of --data / --heldout.")
@click.option("--heldout", "heldout_files", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Held-out text files for the accuracy report (default: the last 5% of --data).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder  [default: the cache, $SPECOPS_CACHE_DIR/medusa/NAME, for a registered model, "
                   "where `Decoder.from_pretrained(NAME)` and `bench decode --model NAME` find them; required "
                   "for a folder]")
@click.option("--self-distill", is_flag=True,
              help="--data / --stdlib: train on the base model's own greedy continuations of prompts cut from the "
                   "text (no original data needed).")
@click.option("--layers", type=click.IntRange(1, 8), default=1, show_default=True, help="Residual blocks per head.")
@click.option("--shared-lm-head/--own-lm-head", default=None,
              help="Reuse the base LM head in every head, so the artifact holds only the residual blocks, or give "
                   "each head its own copy to train  [default: shared with --chat, own otherwise]")
@click.option("--root-input", is_flag=True,
              help="Heads also read the root (the target's own next token) through the base embedding.")
@click.option("--shortlist", type=click.IntRange(0), default=None,
              help="Heads rank only the N most frequent training tokens when decoding (0: all; with --chat they "
                   f"train ranking them too)  [default: {CHAT_SHORTLIST} with --chat (all for a smaller "
                   "vocabulary), 0 otherwise]")
@click.option("--init-heads", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Continue these heads (same --layers and LM-head sharing; --heads at least theirs, extra heads "
                   "start as copies of their last) instead of starting at identity.")
@click.option("--heads", "num_heads", type=click.IntRange(1, 16), default=3, show_default=True,
              help="K: heads to train (head k predicts k tokens beyond the next).")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=CHAT_MINUTES, show_default=True,
              help="--chat: wall budget for the replies, training and the held-out report together.")
@reply_data_options("Reply positions to collect at most.", scope="--chat: ")
@click.option("--steps", type=click.IntRange(1), default=None,
              help=f"Optimizer steps  [default: {TEXT_STEPS} with --data / --stdlib; with --chat, until the "
                   "budget is spent]")
@click.option("--batch-size", type=click.IntRange(1), default=8, show_default=True,
              help="Training sequences per optimizer step.")
@click.option("--seq-len", type=click.IntRange(8), default=128, show_default=True,
              help="Positions per training sequence (--chat: replies packed one after another).")
@click.option("--distill-sequences", type=click.IntRange(1), default=256, show_default=True,
              help="--self-distill: greedy continuations to generate.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True)
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="Tokenizer folder (default: the model folder, then its parent).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True, help="torch CPU threads.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True, help="Log progress messages.")
def train_heads_command(model_ref, chat, data_files, stdlib, heldout_files, out_dir, self_distill, layers,
                        shared_lm_head, root_input, shortlist, init_heads, num_heads, minutes, tokens, self_prompts,
                        max_batch, steps, batch_size, seq_len, distill_sequences, lr, tokenizer_dir, seed, threads,
                        quiet, verbose):
    """Train Medusa heads on a frozen base model and report per-head top-1/top-5 accuracy.

    \b
    On the model's own chat replies, into the cache (found by `Decoder.from_pretrained(NAME)`
    and `bench decode --model NAME --methods medusa`):
      specops train heads --model smollm2-135m-instruct --chat
    On text:
      specops train heads --model PATH --data FILES --self-distill --out DIR
    """
    from specops.models.medusa_heads import default_dir
    from specops.models.resolve import is_registered
    from specops.train.heads import ChatData, HeadsJob, HeadsTrainConfig, run_chat_heads_job, run_heads_job

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = click.get_current_context()
    given = {name for name in TEXT_ONLY + CHAT_ONLY if ctx.get_parameter_source(name) != ParameterSource.DEFAULT}
    if sum((chat, stdlib, bool(data_files))) != 1:
        raise click.UsageError("give --data files or --stdlib, or --chat for the model's own chat replies "
                               "(one of them)")
    wrong = [_flag(n) for n in (TEXT_ONLY if chat else CHAT_ONLY) if n in given]
    if wrong:
        where = "--data / --stdlib" if chat else "--chat"
        raise click.UsageError(f"{', '.join(wrong)} only applies with {where}")
    registered = is_registered(model_ref)
    model_path = MODEL_FOLDER.convert(model_ref, None, ctx)
    if out_dir is None:
        if not registered:
            raise click.UsageError("give --out DIR for a model folder (a registered model's heads go to the cache)")
        out_dir = default_dir(model_ref)
    if shared_lm_head is None:
        shared_lm_head = chat
    if shortlist is None:
        shortlist = CHAT_SHORTLIST if chat and _vocab_size(model_path) > CHAT_SHORTLIST else 0
    cfg = HeadsTrainConfig(num_heads=num_heads, num_layers=layers, shared_lm_head=shared_lm_head, root_input=root_input,
                           shortlist=shortlist, self_distill=self_distill,
                           steps=steps if steps is not None or chat else TEXT_STEPS, batch_size=batch_size,
                           seq_len=seq_len, distill_prompt_len=max(1, min(32, seq_len // 4)),
                           distill_sequences=distill_sequences, lr=lr, seed=seed, progress=not quiet)
    data = ChatData(minutes=minutes, positions=tokens, self_prompts=self_prompts, max_batch=max_batch)
    try:
        cfg.validate()
        data.validate()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if stdlib:
        if heldout_files:
            raise click.UsageError("--stdlib brings its own held-out files: drop --heldout")
        from specops.train.data import split_stdlib

        split = split_stdlib()
        data_files, heldout_files = split.train_files, split.heldout_files
    job = HeadsJob(model=model_path, data_files=tuple(data_files), out_dir=out_dir,
                   heldout_files=tuple(heldout_files), tokenizer=tokenizer_dir, threads=threads, init_heads=init_heads,
                   model_name=model_ref if registered else "")
    if chat:
        _check_chat_template(model_path, tokenizer_dir)
    try:
        result = run_chat_heads_job(job, cfg, data) if chat else run_heads_job(job, cfg)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(result, indent=2))
    for k in range(num_heads):
        text = (f"held-out text top-1 {result['text_top1'][k]:.3f} top-5 {result['text_top5'][k]:.3f} | "
                if "text_top1" in result else "held-out replies: ")
        click.echo(f"head {k + 1} (predicts t+{k + 2}): {text}vs base greedy top-1 {result['greedy_top1'][k]:.3f} "
                   f"top-5 {result['greedy_top5'][k]:.3f}")
    decode = result.get("heldout_decode") or {}
    if decode:
        click.echo(f"held-out greedy medusa: {decode['tokens_per_target_forward']:.2f} tokens per target forward, "
                   f"exact {decode['exact_prompts']}")
    if chat:
        click.echo(f"wrote {result['out']} ({result['artifact_bytes'] / 2**20:.2f} MiB; loss plot: loss.png)")


def _vocab_size(model: Path) -> int:
    """The model folder's vocabulary size (0 when its config.json does not say)."""
    try:
        return int(json.loads((Path(model) / "config.json").read_text()).get("vocab_size") or 0)
    except (OSError, ValueError, TypeError):
        return 0


def _check_chat_template(model: Path, tokenizer_dir: Path | None) -> None:
    """A usage error unless the model's tokenizer has a chat template (what --chat renders prompts with)."""
    from specops.bench.chat_suite import has_chat_template
    from specops.train.heads import _find_tokenizer

    try:
        tokenizer = _find_tokenizer(model, tokenizer_dir)
    except (ValueError, OSError) as exc:
        raise click.UsageError(str(exc)) from None
    if not has_chat_template(tokenizer):
        raise click.UsageError(f"--chat renders its prompts with the model's chat template; the tokenizer of {model} "
                               "has no chat template (train on text with --data or --stdlib)")
